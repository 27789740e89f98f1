"""Weight-only quantization: int8 or float8 (e4m3) weights with one scale per output channel; int4 weights with a
scale and zero per group of 32 (`layers/int4.py`), rounded from float weights (`int4`) or kept as a GGUF stores
them (`gguf`, the default for a quantized GGUF: see `quantize_model`).

Computed at load from the checkpoint's weights. The matmul dequantizes one matrix at a time just before
use (the full-precision copy lives only in cache) and applies the scale to the output, which equals
scaling the weights: y[:, n] = s[n] * sum_k x[:, k] q[n, k]. Reading int8/fp8 weights moves a quarter of the
bytes of float32 (half of bfloat16) from memory, which is what bounds small-batch decoding on CPUs.

On CUDA GPUs with FP8 tensor cores (compute capability >= 8.9) and bfloat16 compute, fp8 layers instead run
`torch._scaled_mm`: activations are quantized per token (dynamic row-wise scale), weights keep their
per-channel scale, and the GPU multiplies in fp8 — what vLLM calls fp8 with dynamic per-token activation
scales. A start-up probe checks the kernel against the dequantizing path and falls back if it fails.

On CPUs, int8 matrices (int8 layers, and the int8 embedding/LM head of both modes) multiply small steps with
torch's int8 weight-only kernel (`torch._weight_int8pack_mm`): it reads the int8 weights directly, with
bfloat16 activations and output, instead of materializing a float copy of each matrix. On a 2-core AVX2 CPU a
decode step of SmolLM2's int8 matrices takes 28 ms with it against 138 ms dequantizing at one row, 254 against
357 ms at 32 rows, and 485 against 386 ms at 64 (`benchmarks/linear_weight_formats.py`), so float32 compute
hands steps of up to 32 rows to the kernel; with bfloat16 compute on a CPU without native bf16 the kernel wins
at every size.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import platform
from kvflow.kernels import build, ops
from kvflow.kernels.formats import WeightFormat, format_of
from kvflow.kernels.group_quant import GroupQuantized
from kvflow.kernels.layout import GROUP
from kvflow.layers import int4
from kvflow.layers.int4 import Int4Linear
from kvflow.layers.swap import swap_matrices

log = logging.getLogger("kvflow")

QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
METHODS = (*QUANT_DTYPES, "int4", "gguf")
_QMAX = {"int8": 127.0, "fp8": 448.0}
HEAD_CHUNK_ROWS = 4096     # the LM head is dequantized in slices that fit in cache
INT8_KERNEL_MAX_ROWS = 32  # float32 compute: steps up to this many rows use the int8 kernel (crossover 32-64)
ALWAYS = 1 << 62


def quantize_rows(weight: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (quantized [N, K], float32 scale [N]) with per-row (output channel) absmax scaling."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / _QMAX[method]).clamp(min=1e-12)
    q = w / scale[:, None]
    q = q.round().clamp(-127, 127).to(torch.int8) if method == "int8" else q.to(torch.float8_e4m3fn)
    return q, scale


def _dequant_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x, to_float(q, x.dtype)) * scale.to(x.dtype)


# e4m3 -> float by moving bits: the sign to the top, exponent and mantissa (7 bits) right under it, then a
# multiply by 2**120 that turns e4m3's exponent bias (7) into float32's or bfloat16's (127). Subnormals come
# out right too (both are 0.m x 2**(1 - bias)). torch's own conversion on CPU is scalar: 5.2 ms against 0.58 ms
# for a 3072x576 matrix here (ad hoc); a decode step's conversions + matmuls, 532 ms against 96
# (`benchmarks/linear_weight_formats.py`). The NaN code is the only one it maps differently; weights have none.
_E4M3_FLOAT32_MASK = torch.tensor(0x87F00000).to(torch.int32).item()
_E4M3_BFLOAT16_MASK = torch.tensor(0x87F0).to(torch.int16).item()


def to_float(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Any tensor to `dtype`; float8 e4m3 on CPU by the bit moves above."""
    if q.dtype != torch.float8_e4m3fn or q.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return q.to(dtype)
    if dtype == torch.float32:
        bits = q.view(torch.int8).to(torch.int32).bitwise_left_shift_(20).bitwise_and_(_E4M3_FLOAT32_MASK)
    else:
        bits = q.view(torch.int8).to(torch.int16).bitwise_left_shift_(4).bitwise_and_(_E4M3_BFLOAT16_MASK)
    return bits.view(dtype).mul_(2.0 ** 120)


def _int8_kernel_matmul(x: torch.Tensor, q: torch.Tensor, scale_bf16: torch.Tensor) -> torch.Tensor:
    """y = x @ (q * scale).T by torch's CPU int8 weight-only kernel: bf16 activations, fp32 accumulation."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    # its AVX-512 loop uses aligned loads; data_ptr cannot be traced, so compiled code always takes a fresh
    # (64-byte aligned) copy
    if torch.compiler.is_compiling() or not rows.is_contiguous() or rows.data_ptr() % 64:
        rows = rows.clone(memory_format=torch.contiguous_format)
    y = torch._weight_int8pack_mm(rows, q, scale_bf16)
    return y.to(x.dtype).view(*x.shape[:-1], q.shape[0])


def int8_kernel_supported(device: torch.device, in_features: int) -> bool:
    """The kernel's vector loops step K by 16 (AVX-512) or 8 (AVX2) with no remainder loop: other K read past
    the row (wrong sums or a crash), so they keep the dequantizing path."""
    return device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm") and in_features % 16 == 0


def _fp8_scaled_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x @ (q * scale).T with both operands in fp8 on the GPU's tensor cores (row-wise scales)."""
    rows = x.reshape(-1, x.shape[-1])
    x_scale = (rows.abs().amax(dim=-1, keepdim=True).float() / _QMAX["fp8"]).clamp(min=1e-12)
    xq = (rows.float() / x_scale).clamp(-_QMAX["fp8"], _QMAX["fp8"]).to(torch.float8_e4m3fn)
    y = torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=x.dtype)
    return y.view(*x.shape[:-1], q.shape[0])


def fp8_matmul_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """FP8 tensor cores (Ada / Hopper and later) and bf16 activations, which row-wise scaling requires."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


class QuantizedRows(nn.Module):
    """An [N, K] matrix stored as quantized rows with one scale per row: what linear layers and vocabulary
    tables share."""

    def __init__(self, weight: torch.Tensor, method: str):
        super().__init__()
        q, scale = quantize_rows(weight, method)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.int8_kernel_rows = 0    # set by quantize_model: steps of up to this many rows use the int8 kernel

    def use_int8_kernel(self, max_rows: int) -> None:
        self.register_buffer("scale_bf16", self.scale.to(torch.bfloat16))   # the kernel takes scales in x's dtype
        self.int8_kernel_rows = max_rows

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ (q * scale).T by the int8 kernel for small steps, else dequantizing."""
        if x.numel() <= self.int8_kernel_rows * x.shape[-1]:
            return _int8_kernel_matmul(x, self.qweight, self.scale_bf16)
        return _dequant_matmul(x, self.qweight, self.scale)


class QuantizedLinear(QuantizedRows):
    def __init__(self, linear: nn.Linear, method: str):
        super().__init__(linear.weight, method)
        self.bias = linear.bias
        self.fp8_matmul = False      # set by quantize_model when the GPU multiplies fp8 natively

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _fp8_scaled_matmul(x, self.qweight, self.scale) if self.fp8_matmul else self.matmul(x)
        return y + self.bias if self.bias is not None else y


class QuantizedEmbedding(QuantizedRows):
    """A quantized [vocab, hidden] table: the embedding (lookups) and/or the LM head (`project`), tied or not."""

    def __init__(self, table: nn.Embedding | nn.Linear, method: str, dtype: torch.dtype):
        super().__init__(table.weight, method)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.view(torch.uint8)[ids].view(self.qweight.dtype)   # CPU cannot index fp8 directly
        return rows.to(self.dtype) * self.scale[ids, None].to(self.dtype)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.numel() <= self.int8_kernel_rows * hidden.shape[-1]:
            return _int8_kernel_matmul(hidden, self.qweight, self.scale_bf16)
        # dequantizing the whole table at once would stream a float copy through DRAM: slice by slice instead
        return torch.cat([_dequant_matmul(hidden, q, s) for q, s in
                          zip(self.qweight.split(HEAD_CHUNK_ROWS), self.scale.split(HEAD_CHUNK_ROWS))], dim=-1)


def _probe(kernel: str, matmul, matrix: QuantizedRows, tolerance: float, **like) -> str | None:
    """None when `matmul(x)` (a torch kernel) runs on this matrix and matches the dequantizing path, else why not."""
    x = torch.randn(5, matrix.qweight.shape[1], **like)
    try:
        fast = matmul(x).float()
    except (RuntimeError, TypeError) as e:
        return f"{kernel} failed: {str(e).splitlines()[0]}"
    ref = _dequant_matmul(x, matrix.qweight, matrix.scale).float()
    err = ((fast - ref).norm() / ref.norm().clamp(min=1e-12)).item()
    return None if err < tolerance else f"{kernel} differs from the reference by {err:.1%}"


def quantize_model(model: nn.Module, method: str, dtype: torch.dtype, native: bool = False) -> str:
    """Swap the model's linear layers, embedding and LM head for quantized ones, in place.
    Returns how the quantized linear layers multiply (the kernel plan's `matmuls`, logged at boot). `native`: the
    kernel plan's `native_matmuls` (kvflow's kernels multiply the codes they hold; torch's kernels otherwise).

    int8 / fp8: per-channel codes rounded from the float weights. int4: group-32 codes rounded to nearest from the
    float weights (layers whose K is not a multiple of 32 take int8). gguf: the file's own codes, as
    `iter_weights(keep_quantized=True)` attached them to the layers they were loaded into (`gguf_pieces`):
    4-bit ones run as int4, 8-bit ones (Q8_0, re-rounded K-quants) and Q6_K's 6-bit ones through kvflow's kernels
    where they run (else as per-channel int8), float ones stay float."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    if method != "gguf":
        fill_gguf_floats(model)
    if method in QUANT_DTYPES:
        # the embedding and LM head are int8 in both modes: e4m3's 3-bit mantissa costs the small embedded model
        # >3% perplexity there, where vLLM would keep them unquantized
        swap_matrices(model, linear=lambda layer: QuantizedLinear(layer, method),
                      table=lambda table: QuantizedEmbedding(table, "int8", dtype))
    else:
        tied = getattr(model, "lm_head", True) is None
        swap_matrices(model, linear=lambda layer: _trimmed(_int4_linear(layer, method, native)),
                      table=lambda table: _trimmed(_vocabulary(table, method, dtype, tied, native)))
        fill_gguf_floats(model)         # whatever kept its floats (a module the swap did not visit)
    return _choose_matmul(model, method, dtype)


def _trimmed(module: nn.Module) -> nn.Module:
    """`module`, after giving the heap's free pages back to the OS: building a matrix's module from GGUF codes frees
    decode and packing temporaries of a few MiB to tens of MiB each, below glibc's mmap threshold once it has risen,
    and the heap kept them, so the process grew by ~0.3 GiB over a 0.5B model's matrices until the trim after
    loading (`platform.release_freed_memory`, ~1 ms a call)."""
    platform.release_freed_memory()
    return module


def fill_gguf_floats(module: nn.Module) -> nn.Module:
    """Writes the float values of the GGUF codes a module was loaded with into its weight, for a module that keeps
    (or is built from) float weights after all; the loader leaves them unwritten (`LlamaForCausalLM.load_weights`),
    so that a model whose matrices all become quantized modules never holds its float copy. Idempotent."""
    for sub in module.modules():
        pieces = getattr(sub, "gguf_pieces", None)
        if not pieces or getattr(sub, "gguf_floats_filled", False):
            continue
        with torch.no_grad():
            for codes, (start, end) in zip(pieces, sub.gguf_rows):
                if codes is not None:
                    sub.weight[start:end].copy_(codes.dequantize())
        sub.gguf_floats_filled = True
    return module


def _gguf_codes(module: nn.Module) -> GroupQuantized | None:
    """The file's codes for every piece this (possibly fused) matrix was loaded from, stacked; None if any piece
    came as floats."""
    pieces = getattr(module, "gguf_pieces", None)
    if not pieces or any(p is None for p in pieces):
        return None
    pieces = [p.resolve() for p in pieces]         # the loader's DeferredCodes, decoded now (one matrix at a time)
    if len({(p.bits, p.group) for p in pieces}) > 1:      # e.g. Q4_K q/k with a Q6_K v: the finer format for all
        return GroupQuantized.cat([_as_8_bit(p) for p in pieces])
    return GroupQuantized.cat(pieces)


def _as_8_bit(codes: GroupQuantized) -> GroupQuantized:
    """8-bit symmetric group-32 codes of the same values: 8-bit pieces (Q8_0, Q5_0) and Q4_0's codes (q - 8, scale
    d) as they are, exactly; 4-bit codes with a minimum (Q4_1, Q4_K) and 6-bit ones (Q6_K) rounded to nearest,
    piece by piece."""
    if codes.bits == 8 and codes.zero is None and codes.offset == 0:
        return codes
    if codes.bits == 4 and codes.zero is None:
        return GroupQuantized((codes.codes.to(torch.int16) - codes.offset).to(torch.int8), codes.scale, None,
                              codes.group, 8, codes.exact)
    return GroupQuantized.round_to_nearest(codes.dequantize(), bits=8, group=GROUP)


def _int4_linear(layer: nn.Linear, method: str, native: bool) -> nn.Module:
    if method == "int4":
        if layer.in_features % 32:
            return QuantizedLinear(layer, "int8")
        return Int4Linear(GroupQuantized.round_to_nearest(layer.weight, bits=4, group=32), layer.bias, native)
    codes = _gguf_codes(layer)
    if codes is None:
        return fill_gguf_floats(layer)
    if codes.bits == 4:
        return Int4Linear(codes, layer.bias, native).to(layer.weight.device)
    if native and (fmt := _wide_format(codes)) is not None:
        return NativeQ8Linear(codes, layer.bias, fmt).to(layer.weight.device)
    return QuantizedLinear(fill_gguf_floats(layer), "int8")


class NativeQ8Linear(nn.Module):
    """8-bit group-32 codes (Q8_0, Q5_0, or K-quants re-rounded to it) or Q6_K's 6-bit ones multiplied by kvflow's
    kernel for steps of every size, each row alone: where the 4-bit layers run kvflow's kernels, these must too, or
    a row's bits would depend on its step again (torch's int8 kernel takes bf16 activations and is not batch
    invariant). Held in the narrowest weight format that holds the codes exactly (kernels/formats.py): codes that are
    5-bit ones (Q5_0's q - 16, -16..15) in 5 bits, which kvflow's 5-bit kernel multiplies to the same bits as the
    8-bit one; Q6_K's in its own 6-bit layout, with their int8 multiplier per 16 columns and d per 256, as the file
    holds them."""

    def __init__(self, codes: GroupQuantized, bias: torch.Tensor | None, fmt: WeightFormat | None = None):
        """`fmt`: the codes' format where the caller has looked it up already (`format_of`)."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.format = fmt or format_of(codes)
        if self.format is None or self.format.bits == 4:
            raise ValueError("NativeQ8Linear takes 8-bit group-32 codes or Q6_K's 6-bit ones")
        packed, scale, _ = self.format.pack(codes)
        self.register_buffer("codes", packed)
        self.register_buffer("scale", scale)
        self.bias = bias

    @property
    def code_bits(self) -> int:
        return self.format.bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)
        return y + self.bias if self.bias is not None else y

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """As an LM head."""
        y = ops.x16_linear(hidden.float(), self.codes, self.scale, _NO_MINIMUM, self.format.bits)
        return y[..., :self.out_features].to(hidden.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 values of rows `ids` (a tied embedding's lookups from the head's own codes): the file's."""
        return self.format.row_values(self.codes, self.scale, _NO_MINIMUM, ids, self.out_features)

    def int8_codes(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the codes, as int8 [*ids, K] (6-bit ones less 32: value = code * its scale)."""
        return self.format.int8_rows(self.codes, ids)

    def native_matrix(self) -> tuple[WeightFormat, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(format, codes, scales, minimums) as kvflow's kernels read them."""
        return self.format, self.codes, self.scale, _NO_MINIMUM


_NO_MINIMUM = torch.empty(0)        # what a format without minimums passes for them


class GGUFVocabulary(nn.Module):
    """The vocabulary table kept as the file stores it: lookups dequantize the rows they need from the file's own
    codes (exact values). With `native_head` (kvflow's kernels run here: 4-bit or 8-bit group-32 codes, or Q6_K's)
    the table is held in its kernel's layout (`head`, an Int4Linear or NativeQ8Linear), which serves the lookups
    (`head.rows`) and, when tied, the LM head's matmuls: no second copy. Otherwise, when tied, the head is a
    separate matrix (`head`) quantized for matmuls."""

    def __init__(self, codes: GroupQuantized, head: nn.Module | None, dtype: torch.dtype,
                 native_format: WeightFormat | None = None):
        """`native_format`: the codes' weight format where kvflow's kernels hold the table (`native_head`)."""
        super().__init__()
        self.group, self.offset, self.dtype = codes.group, codes.offset, dtype
        self.num_rows = codes.shape[0]
        self.native_head = native_format is not None
        if self.native_head:
            self.head = (Int4Linear(codes, None, native=True) if native_format.bits == 4
                         else NativeQ8Linear(codes, None, native_format))
            return
        self.register_buffer("codes", codes.codes)
        self.register_buffer("scale", codes.scale)
        self.register_buffer("zero", codes.zero)          # None for symmetric codes (Q4_0, Q8_0)
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.native_head:
            return self.head.rows(ids).to(self.dtype)
        q = self.codes[ids].to(torch.float32)
        q = q.view(*ids.shape, -1, self.group) - self.offset
        rows = q * self.scale[ids][..., None]
        if self.zero is not None:
            rows += self.zero[ids][..., None]
        return rows.flatten(-2).to(self.dtype)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.project(hidden)[..., :self.num_rows]


def _wide_format(codes: GroupQuantized) -> WeightFormat | None:
    """The weight format of 5 bits or more (NativeQ8Linear's) that holds these codes exactly, or None."""
    fmt = format_of(codes)
    return fmt if fmt is not None and fmt.bits != 4 else None


def _vocabulary(table: nn.Embedding | nn.Linear, method: str, dtype: torch.dtype, tied: bool,
                native: bool) -> nn.Module:
    """int4: int8 rows shared by lookups and the head, as the int8 mode. gguf: an untied LM head from 4-bit codes
    runs as int4, from 8-bit group codes or Q6_K's through kvflow's kernel where it runs, else as int8; the
    embedding keeps the file's codes for its lookups, and when it doubles as the head, kvflow's kernels multiply
    those same codes where they run (one copy), else the head is its own int8 matrix (the int8 kernel)."""
    codes = _gguf_codes(table) if method == "gguf" else None
    if codes is None:
        fill_gguf_floats(table)
        return QuantizedEmbedding(table, "int8", dtype) if method == "int4" else table
    device = table.weight.device
    if isinstance(table, nn.Linear):
        if codes.bits == 4:
            return Int4Linear(codes, None, native).to(device)
        if native and (fmt := _wide_format(codes)) is not None:     # the codes themselves
            return NativeQ8Linear(codes, None, fmt).to(device)
        return QuantizedEmbedding(fill_gguf_floats(table), "int8", dtype)
    fmt = format_of(codes) if native else None      # the table in the kernel's layout where it runs
    if not tied or fmt is not None:     # lookups (4-bit codes packed two a byte), and the tied head's matmuls
        return GGUFVocabulary(codes, None, dtype, native_format=fmt).to(device)
    return GGUFVocabulary(codes, QuantizedEmbedding(fill_gguf_floats(table), "int8", dtype), dtype).to(device)


def _choose_matmul(model: nn.Module, method: str, dtype: torch.dtype) -> str:
    matrices = [m for m in model.modules() if isinstance(m, QuantizedRows)]
    linears = [m for m in matrices if isinstance(m, QuantizedLinear)]
    kernel = _choose_int8_kernel([m for m in matrices if m.qweight.dtype == torch.int8], dtype)
    if method == "fp8" and linears:
        how = _choose_fp8_matmul(linears, dtype)
    elif method in ("int4", "gguf"):
        how = _choose_int4_kernel([m for m in model.modules() if isinstance(m, Int4Linear)], dtype)
    else:
        how = f"{method} weights" + ("" if kernel else ", dequantized per matrix before each matmul")
    return f"{how}; {kernel}" if kernel else how


def _choose_int4_kernel(layers: list[Int4Linear], dtype: torch.dtype) -> str:
    if not layers:
        return "no int4 matrices"
    if all(m.native for m in layers):
        return (f"int4 matrices use kvflow's {build.isa().upper()} kernel (16 weight rows interleaved, int8 "
                "activations per group of 32) for every step, as do 8-bit matrices and a tied LM head (the "
                "embedding's own codes)")
    if not any(m.uses_kernel for m in layers):
        return "int4 matrices dequantized per matrix before each matmul (no usable torch int4 CPU kernel here)"
    rows, table = int4.choose_kernel_rows(layers, dtype)
    for m in layers:
        if m.uses_kernel:
            m.kernel_rows = rows
    measured = ", ".join(f"{r}: {k:.2f}/{d:.2f}" for r, (k, d) in table.items())
    log.info("int4 kernel vs dequantized %s matmul, ms on %d matrices by rows: %s",
             str(dtype).removeprefix("torch."), min(4, len(layers)), measured)
    steps = "every step" if rows == int4.ALWAYS else f"steps of <= {rows} rows (dequantized above)"
    return f"int4 matrices use torch's int4 CPU kernel (bf16 activations) for {steps}"


def _choose_fp8_matmul(linears: list[QuantizedLinear], dtype: torch.dtype) -> str:
    device = linears[0].qweight.device
    if not fp8_matmul_supported(device, dtype):
        return "fp8 weights, dequantized per matrix before each matmul (no fp8 tensor cores / bf16 here)"
    first = linears[0]
    problem = _probe("torch._scaled_mm", lambda x: _fp8_scaled_matmul(x, first.qweight, first.scale), first, 0.1,
                     device=device, dtype=dtype)
    if problem:
        log.warning("fp8: %s; dequantizing instead", problem)
        return "fp8 weights, dequantized per matrix before each matmul (the fp8 kernel failed its probe)"
    for layer in linears:
        layer.fp8_matmul = True
    return "fp8 weights and per-token fp8 activations, torch._scaled_mm on the GPU's fp8 tensor cores"


def _choose_int8_kernel(matrices: list[QuantizedRows], dtype: torch.dtype) -> str:
    """Turn torch's CPU int8 kernel on for the int8 matrices it can multiply, after checking it once per
    input width against the dequantizing path. Returns what was chosen, for the boot log ("" for nothing)."""
    usable = [m for m in matrices if int8_kernel_supported(m.qweight.device, m.qweight.shape[1])]
    if not usable:
        return ""
    for width in sorted({m.qweight.shape[1] for m in usable}):
        m = next(m for m in usable if m.qweight.shape[1] == width)
        problem = _probe("torch._weight_int8pack_mm",
                         lambda x: _int8_kernel_matmul(x, m.qweight, m.scale.to(torch.bfloat16)), m, 0.02)
        if problem:
            log.warning("int8 kernel: %s; dequantizing instead", problem)
            return ""
    # float32 compute keeps dequantizing + MKL for big steps (it wins past 32-64 rows); emulated bf16 never does
    linear_rows = ALWAYS if dtype == torch.bfloat16 and not platform.cpu_has_fast_bf16() else INT8_KERNEL_MAX_ROWS
    for m in usable:
        # the LM head: dequantizing the 49152-row table lost to the kernel at every size measured (1-64 rows)
        m.use_int8_kernel(ALWAYS if isinstance(m, QuantizedEmbedding) else linear_rows)
    rows = "every step" if linear_rows == ALWAYS else f"steps of <= {linear_rows} rows (dequantized above)"
    return f"int8 matrices use torch's int8 CPU kernel (bf16 activations) for {rows} and for the LM head"

