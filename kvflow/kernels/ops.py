"""kvflow's kernels as torch operators (`torch.ops.kvflow.*`, so compiled decode graphs keep them) with their fake
(tracing) kernels, and the threads their calls take. Every one computes each row alone, in one fixed order: a row's
bits do not depend on what shares its step (batch invariance), which torch's kernels do not promise.

- `x16_linear`: x @ W.T for W held in any of formats.py's weight formats (layout x16);
- `paged_attention`: straight from the paged KV cache, in any of `KV_FORMS`;
- `rms_norm`, `lora_add` (each row's own adapter slot), `moe_route` and `moe_experts` (a mixture-of-experts layer's
  router and its stacked experts: csrc/moe.c).
"""
from __future__ import annotations

import torch

from kvflow.kernels import build, formats, layout
from kvflow.kernels.build import Experts
from kvflow.kernels.layout import X16

_threads: int | None = None


def set_threads(n: int | None) -> None:
    """Threads for the kernels' calls from now on (the runner sets them per step: KernelPlan.step_threads); None:
    torch's thread count. Calls of up to plan.SMALL_STEP_ROWS rows run on kvflow's pool (csrc/thread_pool.c)."""
    global _threads
    _threads = n


def threads() -> int:
    return _threads or torch.get_num_threads()


def quiesce() -> None:
    """Waits until no pool worker is inside a call (one preempted in a call that has returned may still read its
    inputs): after it, whatever the calls so far read may be freed."""
    lib = build.library()
    if lib is not None:
        lib.kvflow_pool_quiesce()


# The ops are defined on a plain `torch.library.Library` with CPU and fake (tracing) kernels rather than with
# `torch.library.custom_op`: its Python wrapper cost ~9 us a call, and a batch-1 decode step makes ~210 of these
# calls (measured: RMSNorm 15.5 us a call that way against 7.1 here, of which the kernel takes ~2.5).
_OPS = torch.library.Library("kvflow", "DEF")
_OPS.define("x16_linear(Tensor x, Tensor codes, Tensor scale, Tensor minimum, int bits) -> Tensor")
_OPS.define("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor row_seq, "
            "Tensor positions, float scale, int window=0) -> Tensor")
_OPS.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_OPS.define("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor gu_codes, Tensor gu_scale, Tensor gu_minimum, "
            "int gu_bits, Tensor dn_codes, Tensor dn_scale, Tensor dn_minimum, int dn_bits, int intermediate) -> Tensor")
_OPS.define("moe_route(Tensor x, Tensor router, int k, int rule, bool norm_topk_prob) -> (Tensor, Tensor)")
_OPS.define("lora_add(Tensor out, Tensor x, Tensor a, Tensor b, Tensor pieces, Tensor mask, int max_loras) -> Tensor")


def _x16_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                bits: int) -> torch.Tensor:
    """x [..., K] float32 @ W.T, W held in weight format formats.FORMATS[bits] (its `pack`): [..., padded rows]."""
    return formats.run_linear(build.library(), bits, x, codes, scale, minimum, threads())


# the KV cache element types the attention kernel reads, and its number for each (csrc/attention.c's KV_F32 ..);
# torch.int8: rows of codes and their scale (layers/kv_int8.py)
KV_FORMS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.float8_e4m3fn: 4}


def attention_supports(head_dim: int, kv_dtype: torch.dtype, group: int = 1) -> bool:
    """`group`: query heads per KV head."""
    return kv_dtype in KV_FORMS and head_dim % 8 == 0 and head_dim <= 256 and group <= 32


def _paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     row_seq: torch.Tensor, positions: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """q [T, Hq, D] attending, row t, to keys 0..positions[t] (with `window` > 0: only the last `window` of them,
    positions[t] - window + 1 .. positions[t]) of sequence row_seq[t], whose block table is
    tables[row_seq[t]] (int64), in caches [blocks, block_size, Hkv, row] of any of `KV_FORMS` (row: D, or D + 4
    for int8 rows with their scale) -> [T, Hq, D]. Every row is computed alone, in a fixed order, in float32
    (batch invariant)."""
    dtype = q.dtype
    q = q.float().contiguous()
    out = torch.empty_like(q)
    T, Hq, D = q.shape
    if T:
        err = build.library().kvflow_paged_attention(
                q.data_ptr(), T, Hq, k_cache.shape[2], D, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1],
                tables.data_ptr(), tables.shape[1], row_seq.data_ptr(), positions.data_ptr(), scale, out.data_ptr(),
                threads(), KV_FORMS[k_cache.dtype], window)
        if err == 2:
            raise ValueError(f"native kernel: attention of {Hq} heads over {k_cache.shape[2]} KV heads of {D} is "
                             "not supported (attention_supports)")
        if err:
            raise MemoryError("native kernel: out of memory for attention scores")
    return out.to(dtype)


def stacked_experts(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, k: int) -> tuple:
    """One kind of matrix of every expert, [E, ...] each (minimum: [E, 0] where the codes have none), in weight
    format formats.FORMATS[bits] -> (Experts, output rows), checked as one matrix is: nothing is read past them."""
    fmt = formats.FORMATS.get(bits)
    experts = codes.shape[0]
    n = codes.shape[1] * X16
    held = [scale] + ([minimum] if fmt is not None and fmt.has_minimum else [])
    forms = fmt.scale_forms(scale, minimum) if fmt is not None else [None]
    # elements per expert from the whole tensors' sizes (no per-expert views: this runs every layer of every step)
    each = [t.numel() // experts if experts else 0 for t in (codes, *held)]
    if (fmt is None or codes.dim() != 5 or None in forms or not all(t.is_contiguous() for t in (codes, *held))
            or any(t.shape[0] != experts for t in held) or k % layout.GROUP or each[0] != fmt.code_bytes(n, k)
            or not fmt.scales_fit(n, k, each[1:], forms)):
        raise ValueError("native kernel: stacked experts' weights and scales not in one layout of this shape")
    m = minimum if fmt.has_minimum else None
    spec = Experts(codes.data_ptr(), scale.data_ptr(), m.data_ptr() if m is not None else None,
                   each[0] * codes.element_size(), each[1] * scale.element_size(),
                   each[2] * m.element_size() if m is not None else 0, bits,
                   sum(f << (2 * i) for i, f in enumerate(forms)))
    return spec, n


def experts_pair(gu_codes: torch.Tensor, gu_scale: torch.Tensor, gu_minimum: torch.Tensor, gu_bits: int,
                 dn_codes: torch.Tensor, dn_scale: torch.Tensor, dn_minimum: torch.Tensor, dn_bits: int, hidden: int,
                 intermediate: int) -> tuple[tuple[Experts, int], tuple[Experts, int]]:
    """A layer's stacked gate/up and down matrices (`stacked_experts` each), checked to fit together."""
    gu, gu_rows = stacked_experts(gu_codes, gu_scale, gu_minimum, gu_bits, hidden)
    dn, dn_rows = stacked_experts(dn_codes, dn_scale, dn_minimum, dn_bits, intermediate)
    if gu_rows < 2 * intermediate or dn_rows < hidden or gu_codes.shape[0] != dn_codes.shape[0]:
        raise ValueError("native kernel: the experts' gate/up and down matrices do not fit together")
    return (gu, gu_rows), (dn, dn_rows)


def _moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gu_codes: torch.Tensor,
                 gu_scale: torch.Tensor, gu_minimum: torch.Tensor, gu_bits: int, dn_codes: torch.Tensor,
                 dn_scale: torch.Tensor, dn_minimum: torch.Tensor, dn_bits: int, intermediate: int) -> torch.Tensor:
    """A mixture-of-experts layer's experts (csrc/moe.c): x [T, H] float32, each row's k choices `ids` [T, k]
    and `weights` [T, k] (highest first) -> [T, H], sum_j weights[t, j] * down(SiLU(gate) * up) of expert
    ids[t, j], in j order. The gate/up matrices [E] of [2I (padded), H], the down ones [E] of [H (padded), I],
    stacked, each in its weight format's layout (formats.py)."""
    x = x.float().contiguous()
    T, H = x.shape
    k = ids.shape[1]
    (gu, gu_rows), (dn, dn_rows) = experts_pair(gu_codes, gu_scale, gu_minimum, gu_bits, dn_codes, dn_scale,
                                                dn_minimum, dn_bits, H, intermediate)
    ids = ids.to(torch.int64).contiguous()
    weights = weights.float().contiguous()
    y = torch.empty(T, H, dtype=torch.float32)
    if T:
        err = build.library().kvflow_moe_experts(x.data_ptr(), T, H, ids.data_ptr(), weights.data_ptr(), k,
                                           gu_codes.shape[0], intermediate, gu, gu_rows, dn, dn_rows, y.data_ptr(),
                                           threads())
        if err == 2:
            raise ValueError("native kernel: an expert id out of range")
        if err:
            raise MemoryError("native kernel: out of memory for the experts' activations")
    return y


def _moe_route(x: torch.Tensor, router: torch.Tensor, k: int, rule: int, norm_topk_prob: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts router (csrc/moe.c): x [T, H], router [E, H] -> (weights [T, k] float32, expert ids
    [T, k] int64), highest weight first, by rule `rule` (layers/moe.py's ROUTERS, by index); each row's logits in one
    fixed order (batch invariant)."""
    x = x.float().contiguous()
    router = router.float().contiguous()
    T, H = x.shape
    E = router.shape[0]
    if router.shape[1] != H:
        raise ValueError("native kernel: the router's width is not the rows'")
    weights = torch.empty(T, k, dtype=torch.float32)
    ids = torch.empty(T, k, dtype=torch.int64)
    if T:
        err = build.library().kvflow_moe_route(x.data_ptr(), T, H, router.data_ptr(), E, k, rule, int(norm_topk_prob),
                                         ids.data_ptr(), weights.data_ptr(), threads())
        if err == 2:
            raise ValueError(f"native kernel: top {k} of {E} experts by rule {rule} is not a routing it computes")
        if err:
            raise MemoryError("native kernel: out of memory for the router's logits")
    return weights, ids


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, float32; each row in one fixed order, the same
    in eager and compiled steps."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(rows)
    build.library().kvflow_rms_norm(rows.data_ptr(), rows.shape[0], rows.shape[1], weight.contiguous().data_ptr(), eps,
                              y.data_ptr(), threads())
    return y.view(x.shape)


def _lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, pieces: torch.Tensor,
              mask: torch.Tensor, max_loras: int) -> torch.Tensor:
    """`out` [T, N] plus each row's LoRA term from its slot alone (float32; layers/lora.py has the layout of `a`,
    the flat `b`, `pieces` [P, 3] int64 and `mask`), each row in one fixed order (batch invariant)."""
    y = out.clone(memory_format=torch.contiguous_format)
    x, a, b, mask = x.contiguous(), a.contiguous(), b.contiguous(), mask.contiguous()
    T, K = x.shape
    num_pieces, slots_x_rank = pieces.shape[0], mask.shape[1]
    if (max_loras < 1 or slots_x_rank % max_loras or a.shape != (K, num_pieces * slots_x_rank)
            or mask.shape[0] != T or y.shape[0] != T or pieces.dtype != torch.int64 or pieces.shape[1:] != (3,)):
        raise ValueError("native kernel: LoRA weights and mask not of one layout")     # never read past them
    if T:
        err = build.library().kvflow_lora_add(x.data_ptr(), T, K, a.data_ptr(), mask.data_ptr(), max_loras,
                                        slots_x_rank // max_loras, num_pieces, b.data_ptr(), b.numel(),
                                        pieces.contiguous().data_ptr(), y.data_ptr(), y.shape[1],
                                        threads())
        if err == 2:
            raise ValueError("native kernel: a LoRA piece outside the output or the B weights")
        if err:
            raise MemoryError("native kernel: out of memory for the LoRA term")
    return y



for _name, _kernel in (("x16_linear", _x16_linear), ("paged_attention", _paged_attention), ("rms_norm", _rms_norm),
                       ("lora_add", _lora_add), ("moe_experts", _moe_experts), ("moe_route", _moe_route)):
    _OPS.impl(_name, _kernel, "CPU")
torch.library.register_fake("kvflow::x16_linear", lambda x, codes, scale, minimum, bits:
                            x.new_empty(*x.shape[:-1], layout.out_rows(codes)), lib=_OPS)
torch.library.register_fake("kvflow::paged_attention", lambda q, *rest: torch.empty_like(q), lib=_OPS)
torch.library.register_fake("kvflow::rms_norm", lambda x, weight, eps: torch.empty_like(x), lib=_OPS)
torch.library.register_fake("kvflow::lora_add", lambda out, *rest: out.new_empty(out.shape), lib=_OPS)
torch.library.register_fake("kvflow::moe_experts", lambda x, *rest: x.new_empty(x.shape, dtype=torch.float32),
                            lib=_OPS)
torch.library.register_fake("kvflow::moe_route", lambda x, router, k, rule, norm: (
    x.new_empty(x.shape[0], k, dtype=torch.float32), x.new_empty(x.shape[0], k, dtype=torch.int64)), lib=_OPS)
x16_linear = torch.ops.kvflow.x16_linear.default
paged_attention = torch.ops.kvflow.paged_attention.default
rms_norm = torch.ops.kvflow.rms_norm.default
lora_add = torch.ops.kvflow.lora_add.default
moe_experts = torch.ops.kvflow.moe_experts.default
moe_route = torch.ops.kvflow.moe_route.default
