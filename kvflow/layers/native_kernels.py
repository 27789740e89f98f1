"""kvflow's own CPU kernels (native_kernels.c) for 4-, 5-, 6- and 8-bit group-quantized weights, paged attention,
RMSNorm, LoRA terms and mixture-of-experts layers, built with the machine's C compiler on first use and called as
torch custom ops (so compiled decode graphs keep them). Every one computes each row alone, in one fixed order: a row's bits do not
depend on what shares its step (batch invariance), which torch's kernels do not promise.

The matmul kernels read weights in one layout, "x16" (16 weight rows interleaved per register, repacked at load),
on AVX-512 VNNI (`vpdpbusd`) or AVX2 (`vpmaddubsw`): `isa()` picks once per process, and both give the same bits.
Anything missing (no compiler, no AVX2/FMA, a failed self-check) means None from `library()` and torch's kernels,
never an error. `KVFLOW_NATIVE_KERNELS=0` turns them off; `KVFLOW_NATIVE_ISA=avx2` runs the AVX2 kernels on an
AVX-512 machine (to compare them).

The built library is cached per source hash in $KVFLOW_CACHE_DIR or ~/.cache/kvflow (~1 s to build).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvflow import platform

log = logging.getLogger("kvflow")

SOURCE = Path(__file__).with_suffix(".c")
SOURCES = [SOURCE, SOURCE.with_name("thread_pool.c"), SOURCE.with_name("moe_kernels.c"),
           SOURCE.with_name("decoder_step.c")]       # built from these (and the header)
HEADERS = [SOURCE.with_name("thread_pool.h"), SOURCE.with_name("linear_kernels.h")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-pthread"]
GROUP = 32


def wanted(device: torch.device, dtype: torch.dtype, quantization: str | None = None) -> bool:
    """Where these kernels run: CPU with AVX2 + FMA, float32 compute, or bfloat16 compute where they also multiply
    the weights (4-bit codes: `quantization` "gguf" or "int4"; a float checkpoint's bf16 matmuls are oneDNN's)."""
    if os.environ.get("KVFLOW_NATIVE_KERNELS", "1") == "0" or device.type != "cpu":
        return False
    if dtype != torch.float32 and not (dtype == torch.bfloat16 and quantization in ("gguf", "int4")):
        return False
    flags = platform.cpu_flags()
    return "avx2" in flags and "fma" in flags


def usable() -> bool:
    """kvflow's kernels can run here (CPU flags, compiler, self-check), whatever the dtype chosen."""
    return wanted(torch.device("cpu"), torch.float32) and library() is not None


def compute_dtype(device: torch.device, dtype_setting: str, quantization: str | None) -> torch.dtype | None:
    """float32 for dtype=auto where the weights are 4-bit codes ("gguf", "int4") on a CPU that runs these kernels:
    they compute in float32, and then every step's matmuls, attention and norms are kvflow's batch-invariant
    kernels, also where the CPU has fast bf16 (on AVX-512 VNNI as fast as torch's bf16 int4 kernel at one row and
    ~2x faster from 32 rows, docs/performance.md). None elsewhere: platform.pick_dtype decides."""
    if dtype_setting == "auto" and quantization in ("gguf", "int4") and device.type == "cpu" and usable():
        return torch.float32
    return None


def has_avx512_vnni() -> bool:
    """The CPU runs the AVX-512 VNNI kernels (AVX-512 F and BW, VNNI)."""
    return {"avx512f", "avx512bw", "avx512_vnni"} <= platform.cpu_flags()


@functools.cache
def isa() -> str:
    """"avx512" (the VNNI kernels) where the CPU has them, else "avx2"."""
    return "avx512" if has_avx512_vnni() and os.environ.get("KVFLOW_NATIVE_ISA", "") != "avx2" else "avx2"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None (logged once) when they cannot be built or loaded here."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("native kernels: no C compiler found; torch's int4/int8 kernels instead")
        return None
    source = b"".join(p.read_bytes() for p in [*SOURCES, *HEADERS])
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("KVFLOW_CACHE_DIR") or Path.home() / ".cache" / "kvflow")
    target = cache / f"native_kernels-{key}.so"
    try:
        if not target.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:       # build aside, then rename: atomic
                built = Path(tmp) / target.name
                subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(built)], check=True,
                               capture_output=True, timeout=120)
                built.replace(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("native kernels: build or load failed (%s %s); torch's int4/int8 kernels instead", e,
                    detail.decode(errors="replace")[-500:])
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvflow_q4_linear.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.kvflow_q8_linear.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.kvflow_q5_linear.argtypes = lib.kvflow_q6_linear.argtypes = lib.kvflow_q8_linear.argtypes
    lib.kvflow_paged_attention.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ptr,
                                           ctypes.c_float, ptr, ctypes.c_int, ctypes.c_int, i64]
    lib.kvflow_rms_norm.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr, ctypes.c_int]
    lib.kvflow_rms_norm.restype = None
    lib.kvflow_lora_add.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ctypes.c_int]
    lib.kvflow_lora_add.restype = ctypes.c_int
    lib.kvflow_moe_experts.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, Experts, i64, Experts, i64, ptr,
                                       ctypes.c_int]
    lib.kvflow_moe_experts.restype = ctypes.c_int
    lib.kvflow_moe_route.argtypes = [ptr, i64, i64, ptr, i64, i64, ctypes.c_int, ctypes.c_int, ptr, ptr, ctypes.c_int]
    lib.kvflow_moe_route.restype = ctypes.c_int
    lib.kvflow_decoder_step.argtypes = [ptr, ptr, ptr, ptr, ptr]
    lib.kvflow_decoder_step.restype = ctypes.c_int
    lib.kvflow_decoder_step_scratch.argtypes = [ptr, ptr, i64]
    lib.kvflow_decoder_step_scratch.restype = i64
    lib.kvflow_pool_quiesce.argtypes = lib.kvflow_pool_workers.argtypes = lib.kvflow_pool_rows.argtypes = []
    lib.kvflow_pool_quiesce.restype = None
    lib.kvflow_pool_set_stall.argtypes = [ctypes.c_int]
    lib.kvflow_pool_set_stall.restype = None
    lib.kvflow_x16_use_avx512.argtypes = [ctypes.c_int]
    lib.kvflow_x16_use_avx512.restype = None
    lib.kvflow_x16_use_avx512(int(isa() == "avx512"))
    for fn in (lib.kvflow_q4_linear, lib.kvflow_q8_linear, lib.kvflow_q5_linear, lib.kvflow_q6_linear,
               lib.kvflow_paged_attention):
        fn.restype = ctypes.c_int
    if not _self_check(lib):
        log.warning("native kernels: self-check against torch failed; torch's int4/int8 kernels instead")
        return None
    return lib


X16 = 16      # weight rows per block of the layout


class Experts(ctypes.Structure):
    """moe_kernels.c's experts_t: one kind of matrix of every expert, stacked."""
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("minimum", ctypes.c_void_p),
                ("codes_stride", ctypes.c_int64), ("scale_stride", ctypes.c_int64),
                ("minimum_stride", ctypes.c_int64), ("kind", ctypes.c_int), ("flags", ctypes.c_int)]

_threads: int | None = None


def set_threads(n: int | None) -> None:
    """Threads for the kernels' calls from now on (the runner sets them per step: KernelPlan.step_threads); None:
    torch's thread count. Calls of up to kernel_plan.SMALL_STEP_ROWS rows run on kvflow's pool (native_kernels.c)."""
    global _threads
    _threads = n


def threads() -> int:
    return _threads or torch.get_num_threads()


def quiesce() -> None:
    """Waits until no pool worker is inside a call (one preempted in a call that has returned may still read its
    inputs): after it, whatever the calls so far read may be freed."""
    lib = library()
    if lib is not None:
        lib.kvflow_pool_quiesce()


def padded_rows(n: int) -> int:
    """Rows the kernels' layout holds for an [n, K] matrix (its output has this many columns)."""
    return -(-n // X16) * X16


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (0..15, one per byte) -> the kernels' layout, x16 [N / 16, G, 4, 64] (native_kernels.c),
    rows padded to a multiple of 16 with code 0."""
    k = codes.shape[1]
    quads = _x16(codes.to(torch.uint8), k).reshape(-1, k // GROUP, 2, 4, 64)    # [blocks, G, half, quad c, 16 x 4]
    return (quads[:, :, 0] | (quads[:, :, 1] << 4)).contiguous()


def unpack_q4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`pack_q4`'s inverse: codes [n, k] (padding rows dropped)."""
    quads = torch.stack([packed & 15, packed >> 4], 2).view(-1, k // GROUP, 8, X16, 4)
    return quads.permute(0, 3, 1, 2, 4).reshape(-1, k)[:n]


def pack_q8(codes: torch.Tensor) -> torch.Tensor:
    """8-bit codes [N, K] int8 -> the kernels' layout, x16 [N / 16, G, 8, 64] of code + 128 (uint8)."""
    k = codes.shape[1]
    return (_x16(codes.view(torch.uint8), k) ^ 0x80).reshape(-1, k // GROUP, 8, 64).contiguous()


def fits_q5(codes: torch.Tensor) -> bool:
    """8-bit codes that are 5-bit ones (-16..15: Q5_0's q - 16), which `pack_q5` holds in 5/8 of the bytes."""
    return codes.dtype == torch.int8 and codes.numel() > 0 and -16 <= int(codes.min()) and int(codes.max()) <= 15


def pack_q5(codes: torch.Tensor) -> torch.Tensor:
    """8-bit codes [N, K] in -16..15 -> the 5-bit kernel's layout of code + 16 (native_kernels.c), x16 [N / 16, G,
    5, 64]: 4-bit's four registers, then one whose byte (row, column c % 4 of a quad) holds in bit q the fifth bit
    of quad q."""
    k = codes.shape[1]
    u = (codes.to(torch.int16) + 16).to(torch.uint8)
    nibbles, high = pack_q4(u & 15), u >> 4
    quads = _x16(high, k).reshape(-1, k // GROUP, 8, 64).to(torch.int32)        # [blocks, G, quad, 64]
    bits = (quads << torch.arange(8, dtype=torch.int32)[:, None]).sum(2).to(torch.uint8)
    return torch.cat([nibbles, bits[:, :, None]], dim=2).contiguous()


def q5_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of the int8 codes (-16..15) held in `pack_q5`'s layout."""
    g = packed.shape[1]
    regs = packed.view(-1, g, 5, X16, 4)[rows // X16, :, :, rows % X16]           # [*rows, G, 5, 4]
    nib = torch.cat([regs[..., :4, :] & 15, regs[..., :4, :] >> 4], dim=-2)       # quads 0..7
    high = (regs[..., 4:, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    u = nib | (high << 4)
    return (u.to(torch.int16) - 16).to(torch.int8).reshape(*rows.shape, g * GROUP)


Q6_GROUP_BYTES = 6 * 64 + 2 * X16     # a block's group of 6-bit codes: six registers, then 32 int8 multipliers


def pack_q6(codes: torch.Tensor, multipliers: torch.Tensor) -> torch.Tensor:
    """6-bit codes [N, K] (0..63, one per byte; value (code - 32) * multiplier * d) and their int8 multipliers
    [N, K / 16] -> the 6-bit kernel's layout (native_kernels.c), x16 [N / 16, G, 13, 32] bytes a group: 4-bit's
    four registers of nibbles, two whose byte (row, column c % 4 of a quad) holds the top two bits of quads 0..3
    (4..7) in bits 2q, 2q + 1, then the 16 rows' multipliers of the group's first 16 columns and of its last 16."""
    n, k = codes.shape
    g = k // GROUP
    u = codes.to(torch.uint8)
    nibbles = pack_q4(u & 15)                                                    # [blocks, G, 4, 64]
    high = _x16(u >> 4, k).reshape(-1, g, 2, 4, 64).to(torch.int32)             # [blocks, G, reg, quad, 64]
    tops = (high << (2 * torch.arange(4, dtype=torch.int32))[:, None]).sum(3).to(torch.uint8)
    mult = torch.nn.functional.pad(multipliers.view(torch.uint8), (0, 0, 0, padded_rows(n) - n))
    mult = mult.view(-1, X16, g, 2).permute(0, 2, 3, 1).reshape(-1, g, 2 * X16)   # [blocks, G, half x 16 rows]
    packed = torch.cat([nibbles.view(-1, g, 256), tops.view(-1, g, 128), mult], dim=2)
    return packed.view(-1, g, Q6_GROUP_BYTES // 32, 32).contiguous()


def q6_rows(packed: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `pack_q6`'s layout: (codes - 32 as int8 [*rows, K], multipliers int8 [*rows, K / 16])."""
    g = packed.shape[1]
    flat = packed.view(-1, g, Q6_GROUP_BYTES)
    regs = flat[:, :, :384].view(-1, g, 6, X16, 4)[rows // X16, :, :, rows % X16]     # [*rows, G, 6, 4]
    nib = torch.cat([regs[..., :4, :] & 15, regs[..., :4, :] >> 4], dim=-2)        # quads 0..7
    shifts = (2 * torch.arange(4, dtype=torch.uint8))[:, None]
    top = torch.cat([(regs[..., 4:5, :] >> shifts) & 3, (regs[..., 5:6, :] >> shifts) & 3], dim=-2)
    codes = ((nib | (top << 4)).to(torch.int16) - 32).to(torch.int8).reshape(*rows.shape, g * GROUP)
    mult = flat[:, :, 384:].view(-1, g, 2, X16)[rows // X16, :, :, rows % X16]        # [*rows, G, 2]
    return codes, mult.view(torch.int8).reshape(*rows.shape, 2 * g)


def pack_q6_scales(d: torch.Tensor) -> torch.Tensor:
    """The 6-bit codes' d, fp16 [N, K / 256] (one per 8 groups: a Q6_K block) -> the layout [N / 16, G / 8, 16]."""
    return _scale_layout(d.half())


def q8_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of the int8 codes held in `pack_q8`'s layout (embedding lookups from the LM head's own codes)."""
    g = packed.shape[1]
    quads = packed.view(-1, g, 8, X16, 4)[rows // X16, :, :, rows % X16]        # [*rows, G, 8, 4]
    return (quads ^ 0x80).view(torch.int8).reshape(*rows.shape, g * GROUP)


def pack_scales(t: torch.Tensor, compact: bool = False,
                parts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Per-group scales or minimums [N, G] float32 -> the kernels' layout, [N / 16, G, 16]. `compact`:
    held as the file stores them, which the kernels widen back to the same float32 values: `parts` (Q4_K's
    fp16 super-scale per 8 groups [N, G / 8] and uint8 multiplier [N, G], t == super * multiplier) as one uint8
    buffer, the multipliers then the super-scales, each in the layout; else fp16 where every value is one (GGUF's
    own d and m are); else float32."""
    t = t.float()
    if compact and parts is not None:
        sup, mult = parts
        if t.shape[1] % 8 == 0 and torch.equal(sup.float().repeat_interleave(8, 1) * mult.float(), t):
            return torch.cat([_scale_layout(mult.to(torch.uint8)).view(-1),
                              _scale_layout(sup.half()).view(-1).view(torch.uint8)])
    if compact and torch.equal(t.half().float(), t):
        t = t.half()
    return _scale_layout(t)


def _scale_layout(t: torch.Tensor) -> torch.Tensor:
    n, g = t.shape
    t = torch.nn.functional.pad(t, (0, 0, 0, padded_rows(n) - n))
    return t.view(-1, X16, g).transpose(1, 2).contiguous()


def widen_scales(t: torch.Tensor, n: int, g: int) -> torch.Tensor:
    """`pack_scales`'s output as float32 in the same layout, [N / 16, g, 16]."""
    if t.dtype != torch.uint8:
        return t.float()
    rows = padded_rows(n)
    mult, sup = t[:rows * g], t[rows * g:].view(torch.float16)
    mult, sup = mult.view(-1, g, X16), sup.view(-1, g // 8, X16).repeat_interleave(8, 1)
    return mult.float() * sup.float()


def unpack_scales(t: torch.Tensor, n: int) -> torch.Tensor:
    """`pack_scales`'s layout [N / 16, G, 16] -> [n, G] (padding rows dropped)."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]


def _x16(codes: torch.Tensor, k: int) -> torch.Tensor:
    """[N, K] bytes -> [N / 16, G, 8 quads, 16 rows, 4 bytes], rows padded with zeros."""
    n = codes.shape[0]
    codes = torch.nn.functional.pad(codes, (0, 0, 0, padded_rows(n) - n))
    return codes.view(-1, X16, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4)


# The ops are defined on a plain `torch.library.Library` with CPU and fake (tracing) kernels rather than with
# `torch.library.custom_op`: its Python wrapper cost ~9 us a call, and a batch-1 decode step makes ~210 of these
# calls (measured: RMSNorm 15.5 us a call that way against 7.1 here, of which the kernel takes ~2.5).
_OPS = torch.library.Library("kvflow", "DEF")
_OPS.define("q4_linear(Tensor x, Tensor codes, Tensor scale, Tensor minimum) -> Tensor")
_OPS.define("q8_linear(Tensor x, Tensor codes, Tensor scale) -> Tensor")
_OPS.define("q5_linear(Tensor x, Tensor codes, Tensor scale) -> Tensor")
_OPS.define("q6_linear(Tensor x, Tensor codes, Tensor scale) -> Tensor")
_OPS.define("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor row_seq, "
            "Tensor positions, float scale, int window=0) -> Tensor")
_OPS.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_OPS.define("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor gu_codes, Tensor gu_scale, Tensor gu_minimum, "
            "int gu_bits, Tensor dn_codes, Tensor dn_scale, Tensor dn_minimum, int dn_bits, int intermediate) -> Tensor")
_OPS.define("moe_route(Tensor x, Tensor router, int k, int rule, bool norm_topk_prob) -> (Tensor, Tensor)")
_OPS.define("lora_add(Tensor out, Tensor x, Tensor a, Tensor b, Tensor pieces, Tensor mask, int max_loras) -> Tensor")


def _q4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 @ W.T, W = code * scale + minimum per group of 32 (all three from `pack_q4` /
    `pack_scales`): [..., padded rows]."""
    return _run(library().kvflow_q4_linear, x, codes, scale, minimum, bits=4)


def _q8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 @ W.T, W = code * scale per group of 32 (codes from `pack_q8`)."""
    return _run(library().kvflow_q8_linear, x, codes, scale, bits=8)


def _q5_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 @ W.T, W = code * scale per group of 32, codes -16..15 (from `pack_q5`): the same bits as
    `q8_linear` on the same codes."""
    return _run(library().kvflow_q5_linear, x, codes, scale, bits=5)


def _q6_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 @ W.T, W = (code - 32) * multiplier per 16 columns * d per 256 (codes from `pack_q6`, d
    from `pack_q6_scales`): GGUF Q6_K's values."""
    return _run(library().kvflow_q6_linear, x, codes, scale, bits=6)


def _out_rows(codes: torch.Tensor) -> int:
    return codes.shape[0] * X16


def _paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     row_seq: torch.Tensor, positions: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """q [T, Hq, D] attending, row t, to keys 0..positions[t] (with `window` > 0: only the last `window` of them,
    positions[t] - window + 1 .. positions[t]) of sequence row_seq[t], whose block table is
    tables[row_seq[t]] (int64), in caches [blocks, block_size, Hkv, row] of any of `_KV_FORMS` (row: D, or D + 4
    for int8 rows with their scale) -> [T, Hq, D]. Every row is computed alone, in a fixed order, in float32
    (batch invariant)."""
    dtype = q.dtype
    q = q.float().contiguous()
    out = torch.empty_like(q)
    T, Hq, D = q.shape
    if T:
        err = library().kvflow_paged_attention(
                q.data_ptr(), T, Hq, k_cache.shape[2], D, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1],
                tables.data_ptr(), tables.shape[1], row_seq.data_ptr(), positions.data_ptr(), scale, out.data_ptr(),
                threads(), _KV_FORMS[k_cache.dtype], window)
        if err == 2:
            raise ValueError(f"native kernel: attention of {Hq} heads over {k_cache.shape[2]} KV heads of {D} is "
                             "not supported (attention_supports)")
        if err:
            raise MemoryError("native kernel: out of memory for attention scores")
    return out.to(dtype)


_MOE_KINDS = {4: 0, 8: 1, 5: 2, 6: 3}        # moe_kernels.c's MOE_Q4, MOE_Q8, MOE_Q5, MOE_Q6


def stacked_experts(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, k: int) -> tuple:
    """One kind of matrix of every expert, [E, ...] each (minimum: [E, 0] where the codes have none) ->
    (Experts, output rows), checked as `_run` checks one matrix: nothing is read past them."""
    experts = codes.shape[0]
    n = codes.shape[1] * X16
    tensors = [scale] + ([minimum] if bits == 4 else [])
    forms = _forms(bits, tensors)
    # elements per expert from the whole tensors' sizes (no per-expert views: this runs every layer of every step)
    each = [t.numel() // experts if experts else 0 for t in (codes, *tensors)]
    if (bits not in _MOE_KINDS or codes.dim() != 5 or None in forms
            or not all(t.is_contiguous() for t in (codes, *tensors))
            or any(t.shape[0] != experts for t in tensors) or not _layout_fits(bits, n, k, each, forms)):
        raise ValueError("native kernel: stacked experts' weights and scales not in one layout of this shape")
    m = minimum if bits == 4 else None
    spec = Experts(codes.data_ptr(), scale.data_ptr(), m.data_ptr() if m is not None else None,
                    each[0] * codes.element_size(), each[1] * scale.element_size(),
                    each[2] * m.element_size() if m is not None else 0,
                    _MOE_KINDS[bits],
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
    """A mixture-of-experts layer's experts (moe_kernels.c): x [T, H] float32, each row's k choices `ids` [T, k]
    and `weights` [T, k] (highest first) -> [T, H], sum_j weights[t, j] * down(SiLU(gate) * up) of expert
    ids[t, j], in j order. The gate/up matrices [E] of [2I (padded), H], the down ones [E] of [H (padded), I],
    stacked, in the layouts of `pack_q4` / `pack_q8` / `pack_q5` and `pack_scales`."""
    x = x.float().contiguous()
    T, H = x.shape
    k = ids.shape[1]
    (gu, gu_rows), (dn, dn_rows) = experts_pair(gu_codes, gu_scale, gu_minimum, gu_bits, dn_codes, dn_scale,
                                                dn_minimum, dn_bits, H, intermediate)
    ids = ids.to(torch.int64).contiguous()
    weights = weights.float().contiguous()
    y = torch.empty(T, H, dtype=torch.float32)
    if T:
        err = library().kvflow_moe_experts(x.data_ptr(), T, H, ids.data_ptr(), weights.data_ptr(), k,
                                           gu_codes.shape[0], intermediate, gu, gu_rows, dn, dn_rows, y.data_ptr(),
                                           threads())
        if err == 2:
            raise ValueError("native kernel: an expert id out of range")
        if err:
            raise MemoryError("native kernel: out of memory for the experts' activations")
    return y


def _moe_route(x: torch.Tensor, router: torch.Tensor, k: int, rule: int, norm_topk_prob: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts router (moe_kernels.c): x [T, H], router [E, H] -> (weights [T, k] float32, expert ids
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
        err = library().kvflow_moe_route(x.data_ptr(), T, H, router.data_ptr(), E, k, rule, int(norm_topk_prob),
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
    library().kvflow_rms_norm(rows.data_ptr(), rows.shape[0], rows.shape[1], weight.contiguous().data_ptr(), eps,
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
        err = library().kvflow_lora_add(x.data_ptr(), T, K, a.data_ptr(), mask.data_ptr(), max_loras,
                                        slots_x_rank // max_loras, num_pieces, b.data_ptr(), b.numel(),
                                        pieces.contiguous().data_ptr(), y.data_ptr(), y.shape[1],
                                        threads())
        if err == 2:
            raise ValueError("native kernel: a LoRA piece outside the output or the B weights")
        if err:
            raise MemoryError("native kernel: out of memory for the LoRA term")
    return y


for _name, _kernel in (("q4_linear", _q4_linear), ("q8_linear", _q8_linear), ("q5_linear", _q5_linear),
                       ("q6_linear", _q6_linear),
                       ("paged_attention", _paged_attention), ("rms_norm", _rms_norm), ("lora_add", _lora_add),
                       ("moe_experts", _moe_experts), ("moe_route", _moe_route)):
    _OPS.impl(_name, _kernel, "CPU")
torch.library.register_fake("kvflow::q4_linear", lambda x, codes, scale, minimum:
                            x.new_empty(*x.shape[:-1], _out_rows(codes)), lib=_OPS)
torch.library.register_fake("kvflow::q8_linear", lambda x, codes, scale: x.new_empty(*x.shape[:-1], _out_rows(codes)),
                            lib=_OPS)
torch.library.register_fake("kvflow::q5_linear", lambda x, codes, scale: x.new_empty(*x.shape[:-1], _out_rows(codes)),
                            lib=_OPS)
torch.library.register_fake("kvflow::q6_linear", lambda x, codes, scale: x.new_empty(*x.shape[:-1], _out_rows(codes)),
                            lib=_OPS)
torch.library.register_fake("kvflow::paged_attention", lambda q, *rest: torch.empty_like(q), lib=_OPS)
torch.library.register_fake("kvflow::rms_norm", lambda x, weight, eps: torch.empty_like(x), lib=_OPS)
torch.library.register_fake("kvflow::lora_add", lambda out, *rest: out.new_empty(out.shape), lib=_OPS)
torch.library.register_fake("kvflow::moe_experts", lambda x, *rest: x.new_empty(x.shape, dtype=torch.float32),
                            lib=_OPS)
torch.library.register_fake("kvflow::moe_route", lambda x, router, k, rule, norm: (
    x.new_empty(x.shape[0], k, dtype=torch.float32), x.new_empty(x.shape[0], k, dtype=torch.int64)), lib=_OPS)
q4_linear = torch.ops.kvflow.q4_linear.default
q8_linear = torch.ops.kvflow.q8_linear.default
q5_linear = torch.ops.kvflow.q5_linear.default
q6_linear = torch.ops.kvflow.q6_linear.default
paged_attention = torch.ops.kvflow.paged_attention.default
rms_norm = torch.ops.kvflow.rms_norm.default
lora_add = torch.ops.kvflow.lora_add.default
moe_experts = torch.ops.kvflow.moe_experts.default
moe_route = torch.ops.kvflow.moe_route.default


# the KV cache element types the attention kernel reads, and its number for each (native_kernels.c's KV_F32 ..);
# torch.int8: rows of codes and their scale (layers/kv_int8.py)
_KV_FORMS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.float8_e4m3fn: 4}


def attention_supports(head_dim: int, kv_dtype: torch.dtype, group: int = 1) -> bool:
    """`group`: query heads per KV head."""
    return kv_dtype in _KV_FORMS and head_dim % 8 == 0 and head_dim <= 256 and group <= 32


_FORMS = {torch.float32: 0, torch.float16: 1, torch.uint8: 2}


MINUS_8_D = 3      # a minimum's form (flags bits 2-3): not stored, -8 times d (GGUF Q4_0; `minimums_of` in the C)
PER_8_GROUPS = 3   # the 6-bit codes' d's form (flags bits 0-1): fp16, one per 8 groups (Q6_K's d)


def minimums(minimum: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What a 4-bit matrix holds as its minimums, `pack_scales`'d: nothing (an empty tensor, the kernels' form
    MINUS_8_D) where every one is -8 times its group's scale, as GGUF's Q4_0 defines them; else `minimum` as is."""
    same_form = minimum.dtype == scale.dtype != torch.uint8 and minimum.shape == scale.shape
    return minimum.new_empty(0) if same_form and torch.equal(minimum.float(), -8.0 * scale.float()) else minimum


def minimum_values(minimum: torch.Tensor, scale_values: torch.Tensor) -> torch.Tensor:
    """A matrix's minimums as float32 in the layout of `scale_values` (its widened scales), stored or not."""
    return -8.0 * scale_values if minimum.numel() == 0 else minimum.float()


def _form(t: torch.Tensor, minimum: bool) -> int | None:
    return MINUS_8_D if minimum and t.numel() == 0 else _FORMS.get(t.dtype)


def _forms(bits: int, scales) -> list[int | None]:
    """The forms of a matrix's scales (and minimums); 6-bit codes take one: fp16 d per 8 groups (PER_8_GROUPS)."""
    if bits == 6:
        return [PER_8_GROUPS if i == 0 and t.dtype == torch.float16 else None for i, t in enumerate(scales)]
    return [_form(t, i == 1 and bits == 4) for i, t in enumerate(scales)]


def _scale_elements(form: int, groups: int) -> int:
    """Elements a scale array of this form holds for `groups` groups (two levels: 10 bits a group, as bytes)."""
    return {2: groups * 5 // 4, MINUS_8_D: 0}.get(form, groups)


def _layout_fits(bits: int, n: int, k: int, elements: list[int], forms: list[int]) -> bool:
    """Whether codes and scales (and minimums) of these element counts and forms are one layout of an [n (padded),
    k] matrix of `bits`-bit codes."""
    groups = n * (k // GROUP)
    if k % GROUP or elements[0] != _code_bytes(bits, n, k):
        return False
    if bits == 6:       # d per 8 groups
        return k % (8 * GROUP) == 0 and elements[1:] == [groups // 8]
    return (all(e == _scale_elements(f, groups) for e, f in zip(elements[1:], forms))
            and not (2 in forms and (k // GROUP) % 8))


def _code_bytes(bits: int, n: int, k: int) -> int:
    """Bytes of an [n (padded), k] matrix's codes in the layout of `bits`-bit codes (6-bit: with its multipliers)."""
    return n * (k // GROUP) * Q6_GROUP_BYTES // X16 if bits == 6 else n * k * bits // 8


def linear_flags(codes: torch.Tensor, k: int, bits: int, *scales: torch.Tensor) -> int:
    """The kernels' `flags` for these scales (bits 0-1: d's form, 2-3: m's), after checking that codes and scales
    are one layout of an [out rows, k] matrix of `bits`-bit codes: a kernel never reads past them."""
    n = _out_rows(codes)
    # float32, fp16, or two levels (uint8 + fp16, 10 bits each); a 4-bit minimum also MINUS_8_D (nothing stored)
    forms = _forms(bits, scales)
    if None in forms or not all(s.is_contiguous() for s in (codes, *scales)):
        raise ValueError("native kernel: scales must be contiguous float32, float16 or pack_scales' two levels")
    if not _layout_fits(bits, n, k, [t.numel() for t in (codes, *scales)], forms):
        raise ValueError("native kernel: weights and scales not in one layout of this shape")
    return sum(f << (2 * i) for i, f in enumerate(forms))


def _run(fn, x: torch.Tensor, codes: torch.Tensor, *scales: torch.Tensor, bits: int | None = None) -> torch.Tensor:
    """`bits`: the codes' width (default: 4 with a minimum, 8 without)."""
    bits = bits or (4 if len(scales) == 2 else 8)
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    n = _out_rows(codes)
    flags = linear_flags(codes, k, bits, *scales)
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    if rows.shape[0]:
        err = fn(rows.data_ptr(), rows.shape[0], k, codes.data_ptr(), *[s.data_ptr() for s in scales],
                 n, y.data_ptr(), threads(), flags)
        if err:
            raise MemoryError("native kernel: out of memory for its int8 activations")
    return y.view(*x.shape[:-1], n)


def _self_check(lib: ctypes.CDLL) -> bool:
    """This machine's 4-bit and 8-bit kernels (layout x16, its `isa()`'s instructions) against torch on random
    weights (odd row counts and a row count that is not a multiple of 16 included): within what int8 activations
    explain (~1% of the output's scale)."""
    g = torch.Generator().manual_seed(0)
    n, k = 40, 96
    codes4 = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // GROUP, generator=g) * 0.1
    minimum = -8 * scale
    w4 = (codes4.float().view(n, -1, GROUP) * scale[..., None] + minimum[..., None]).view(n, k)
    w8 = (codes8.float().view(n, -1, GROUP) * scale[..., None]).view(n, k)
    for rows in (1, 5, 70):
        x = torch.randn(rows, k, generator=g)
        for fn, w, args in ((lib.kvflow_q4_linear, w4, (pack_q4(codes4), pack_scales(scale), pack_scales(minimum))),
                            (lib.kvflow_q8_linear, w8, (pack_q8(codes8), pack_scales(scale)))):
            want = x @ w.T
            got = _run(fn, x, *args)[:, :n]
            if not torch.allclose(got, want, rtol=0, atol=0.02 * want.abs().max().item()):
                return False
        # 5-bit codes: the very sums (so bits) of the 8-bit kernel on the same codes
        codes5 = torch.randint(-16, 16, (n, k), generator=g, dtype=torch.int8)
        eight = _run(lib.kvflow_q8_linear, x, pack_q8(codes5), pack_scales(scale))
        five = _run(lib.kvflow_q5_linear, x, pack_q5(codes5), pack_scales(scale), bits=5)
        if not torch.equal(five, eight):
            return False
    # 6-bit codes, an int8 multiplier per 16 columns and d per 256 (Q6_K's values), over two blocks of 256
    codes6 = torch.randint(0, 64, (n, 512), generator=g, dtype=torch.uint8)
    mult = torch.randint(-128, 128, (n, 32), generator=g, dtype=torch.int8)
    d6 = (torch.rand(n, 2, generator=g) * 0.001).half()
    scale6 = d6.float().repeat_interleave(16, 1) * mult.float()
    w6 = ((codes6.float() - 32).view(n, -1, 16) * scale6[..., None]).view(n, 512)
    x = torch.randn(7, 512, generator=g)
    want = x @ w6.T
    got = _run(lib.kvflow_q6_linear, x, pack_q6(codes6, mult), pack_q6_scales(d6), bits=6)[:, :n]
    return torch.allclose(got, want, rtol=0, atol=0.02 * want.abs().max().item())
