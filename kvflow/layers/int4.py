"""Int4 linear layers: 4-bit codes with a bf16 scale and zero per group of 32 columns, multiplied by torch's CPU
int4 kernel (`aten._weight_int4pack_mm_for_cpu`) or dequantized to the compute dtype for a float matmul.

The kernel's constraints, found by probing torch 2.13 (tests/test_int4.py keeps them checked): activations
must be bfloat16 (float32 activations take a scalar path ~30-100x slower), and its scales and zeros then
bfloat16 too, so a GGUF's fp16 scales lose 3 mantissa bits (the codes are untouched); group 32/64/128/256 with
K a multiple of it; N a multiple of 16 for the packing (rows are padded here to a multiple of 64 instead, which
also avoids the packer's partial-block layouts). Other shapes, or a torch without the kernel, keep their codes
in a plain nibble layout and always dequantize: never a crash.

Which of the two runs a step is chosen by its number of rows, from a measurement at load (`choose_kernel_rows`,
~0.1 s when the kernel wins outright): the kernel reads 4-bit weights and wins small steps everywhere, while a
large prefill chunk may run faster as one float GEMM over a dequantized copy, depending on the CPU
(docs/performance.md; the crossover table per CPU in docs/measurements/performance-history.md).
The dequantizing path unpacks torch's own packed layout, which differs between AVX-512 and AVX2 builds: it is
learned at start-up by packing known codes, and checked, so no second copy of the codes is kept.
"""
from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels import layout, ops
from kvflow.kernels.formats import FORMATS, WeightFormat
from kvflow.kernels.group_quant import GroupQuantized

log = logging.getLogger("kvflow")

KERNEL_GROUPS = (32, 64, 128, 256)
ROW_PADDING = 64                   # the packer's largest block of rows (AVX-512); a multiple of its 16-row rule
ALWAYS = 1 << 62
MEASURED_ROWS = (1, 4, 16, 32, 64, 128, 256)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


@functools.cache
def packed_layout() -> tuple[int, torch.Tensor] | None:
    """How torch's packer lays out a block of rows: (rows per block, the slot -> row order within a block), or
    None when the kernel is missing, fails, or its layout is not the blocked one expected. Learned by packing a
    matrix whose codes are their own row numbers, then checked on random codes."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    try:
        n = 2 * ROW_PADDING
        rows = torch.arange(n)[:, None].expand(n, 2)
        packed = [_pack((rows >> shift) & 15).view(-1) for shift in (0, 4)]
        slot_rows = sum((torch.stack([p & 15, p >> 4], -1).view(-1).long() << shift)
                        for p, shift in zip(packed, (0, 4)))        # byte j holds slots 2j (low) and 2j + 1
        block = int((slot_rows[1:] == slot_rows[0]).nonzero()[0]) + 1 if (slot_rows[1:] == slot_rows[0]).any() else 0
        if block == 0 or n % block:
            return None
        order = slot_rows[:block]          # k = 0 of the first block: which row each slot holds
        layout = (block, torch.argsort(order))
        codes = torch.randint(0, 16, (n, 96), dtype=torch.uint8)
        return layout if torch.equal(_unpack(_pack(codes), n, 96, layout), codes) else None
    except (RuntimeError, IndexError):
        return None


def _unpack(packed: torch.Tensor, n: int, k: int, layout: tuple[int, torch.Tensor]) -> torch.Tensor:
    """torch's packed [n, k / 2] bytes -> codes [n, k]: blocks of `block` rows, stored k-major, slots in `order`."""
    block, row_slot = layout
    slots = torch.stack([packed & 15, packed >> 4], -1).view(n // block, k, block)
    return slots.index_select(2, row_slot).transpose(1, 2).reshape(n, k)


def kernel_supports(in_features: int, group: int) -> bool:
    return packed_layout() is not None and group in KERNEL_GROUPS and in_features % group == 0


class Int4Linear(nn.Module):
    """y = x @ W.T (+ bias) with W held as 4-bit codes. `kernel_rows`: steps of up to that many rows use the
    kernel, larger ones dequantize (set by `choose_kernel_rows`; ALWAYS where the layout could not be learned).
    `native`: the codes and scales (fp16 where exact, else float32) in the layout of kvflow's own kernel for this
    CPU (kernels/formats.py's 4-bit row: AVX2 or AVX-512 VNNI), which multiplies steps of every size, each row alone (batch
    invariance)."""

    def __init__(self, weight: GroupQuantized, bias: torch.Tensor | None = None, native: bool = False):
        super().__init__()
        if weight.bits != 4:
            raise ValueError(f"Int4Linear takes 4-bit codes, got {weight.bits}-bit")
        self.out_features, self.in_features = n, k = weight.shape
        self.group = weight.group
        self.bias = bias
        self.native = native and FORMATS[4].accepts(weight)
        if self.native:
            self.uses_kernel, self.kernel_rows = False, ALWAYS
            self.padded_out = layout.padded_rows(n)
            # codes, scales and minimums as the 4-bit format holds them (the file's own d and m, Q4_0's not stored)
            packed, scale, minimum = FORMATS[4].pack(weight)
            self.register_buffer("packed", packed)
            self.register_buffer("scale", scale)
            self.register_buffer("minimum", minimum)
            return
        self.uses_kernel = weight.codes.device.type == "cpu" and kernel_supports(k, weight.group)
        pad_to = max(ROW_PADDING, packed_layout()[0]) if self.uses_kernel else 1
        self.padded_out = -(-n // pad_to) * pad_to
        pad = self.padded_out - n
        codes = F.pad(weight.codes, (0, 0, 0, pad)) if pad else weight.codes
        zero = weight.zero_for_offset(8)        # torch's convention: (q - 8) * scale + zero
        # [K / group, N, 2] as the kernel takes them; padded rows are zero
        scale_zero = torch.stack([weight.scale, zero], -1).transpose(0, 1)
        self.register_buffer("scale_zero", F.pad(scale_zero, (0, 0, 0, pad)).to(torch.bfloat16).contiguous())
        self.register_buffer("packed", _pack(codes) if self.uses_kernel else (codes[:, 0::2] | codes[:, 1::2] << 4))
        self.kernel_rows = ALWAYS if self.uses_kernel else 0

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.padded_out, self.in_features
        if self.native:
            n = self.out_features
            codes = FORMATS[4].unpack_codes(self.packed, n, k).view(n, k // self.group, self.group).to(dtype)
            g = k // self.group
            scale = layout.widen_scales(self.scale, n, g)
            minimum = layout.minimum_values(layout.widen_scales(self.minimum, n, g), scale)
            scale, minimum = (layout.unpack_scales(t, n)[..., None].to(dtype) for t in (scale, minimum))
            return (codes * scale + minimum).view(n, k)
        if self.uses_kernel:
            codes = _unpack(self.packed, n, k, packed_layout())
        else:
            codes = torch.stack([self.packed & 15, self.packed >> 4], -1).view(n, k)
        q = codes.view(n, k // self.group, self.group).to(dtype) - 8
        scale, zero = self.scale_zero.to(dtype).transpose(0, 1).unbind(-1)
        return (q * scale[..., None] + zero[..., None]).view(n, k)[:self.out_features]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 values of rows `ids` (native layouts): a tied embedding's lookups from the head's own codes,
        code * scale + minimum as the file defines them (exact for GGUF's formats)."""
        return FORMATS[4].row_values(self.packed, self.scale, self.minimum, ids, self.out_features)

    def native_matrix(self) -> tuple[WeightFormat, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(format, codes, scales, minimums) as kvflow's kernels read them; None where they do not multiply it."""
        return (FORMATS[4], self.packed, self.scale, self.minimum) if self.native else None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            # kvflow's kernel at every step size: dequantizing + MKL is faster above ~192 rows (8 matrices of
            # 1536x576 at 2 threads, AMD EPYC, AVX2, 2026-12-01: 18.7 vs 24.0 ms at 128 rows, 40.7 vs 35.4 at 256,
            # 75.6 vs 54.7 at 512), but it rounds differently, and a row's result would then depend on how many
            # rows share its step (batch invariance, docs/performance.md)
            y = ops.x16_linear(x.float(), self.packed, self.scale, self.minimum, 4)
            if self.padded_out != self.out_features:
                y = y[..., :self.out_features]
            return y.to(x.dtype)
        if x.numel() <= self.kernel_rows * self.in_features:
            return self._kernel(x)
        return F.linear(x, self.dequantize(x.dtype))

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if torch.compiler.is_compiling():       # data_ptr cannot be traced: a fresh (64-byte aligned) copy
            rows = rows.clone(memory_format=torch.contiguous_format)
        elif not rows.is_contiguous() or rows.data_ptr() % 64:
            rows = rows.clone(memory_format=torch.contiguous_format)    # vector loads: contiguous and aligned
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scale_zero)
        if self.padded_out != self.out_features:
            y = y[:, :self.out_features]
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y + self.bias if self.bias is not None else y

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """As an (untied) LM head."""
        return self.matmul(hidden)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group={self.group}, native={self.native}, "
                f"kernel_rows={self.kernel_rows}")


def choose_kernel_rows(layers: list[Int4Linear], dtype: torch.dtype) -> tuple[int, dict[int, tuple[float, float]]]:
    """Time the kernel against dequantize + float matmul (in `dtype`) on a few of the model's own matrices, from
    the largest of MEASURED_ROWS down until the kernel wins: the kernel's time grows with the rows, the
    dequantizing path's is mostly the conversion, so steps up to that size take the kernel. Costs two timings
    where the kernel wins at the largest size. Returns (rows, {rows: (kernel ms, dequantized ms)}); ALWAYS when
    the kernel won at the largest size, 0 when it lost at every size."""
    sample = [m for m in layers if m.uses_kernel][:4]      # (native layers have no choice to make)
    if not sample:
        return 0, {}
    table: dict[int, tuple[float, float]] = {}
    best = lambda fn: min(_timed(fn) for _ in range(2))                 # noqa: E731  (the less disturbed run)
    with torch.inference_mode():
        for rows in sorted(MEASURED_ROWS, reverse=True):
            xs = [torch.randn(rows, m.in_features, dtype=dtype) for m in sample]
            kernel = best(lambda: [m._kernel(x) for m, x in zip(sample, xs)])
            dequantized = best(lambda: [F.linear(x, m.dequantize(dtype)) for m, x in zip(sample, xs)])
            table[rows] = (kernel * 1e3, dequantized * 1e3)
            if kernel <= dequantized:
                return (ALWAYS if rows == max(MEASURED_ROWS) else rows), dict(sorted(table.items()))
    return 0, dict(sorted(table.items()))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
