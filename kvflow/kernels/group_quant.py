"""A weight matrix as integer codes with a scale and zero per group of columns: what a GGUF's Q4_0 / Q4_1 / Q8_0 /
Q5_0 / Q4_K / Q6_K blocks are, and what torch's int4 kernel and kvflow's kernels multiply.

value[n, k] = (code[n, k] - offset) * scale[n, g] + zero[n, g], g = k // group. Every GGUF block format kept here
maps into it without touching the codes, and with the file's own float32 arithmetic, so `dequantize` gives
gguf's float32 values bit for bit: one exact product, then at most one rounded addition, as gguf computes them.
  Q4_0  d * (q - 8)           offset 8, scale d, no zero            4-bit codes 0..15
  Q4_1  d * q + m             offset 0, scale d, zero m             4-bit
  Q4_K  d*sc * q - dmin*m     offset 0, scale d*sc, zero -(dmin*m)  4-bit, per sub-block of 32 (both products
                                                                    exact in float32: 11 x 6 mantissa bits)
  Q8_0  d * q                 offset 0, scale d, no zero            8-bit codes -128..127
  Q5_0  d * (q - 16)          offset 0, scale d, no zero            8-bit codes q - 16 (-16..15)
  Q6_K  d*sc * (q - 32)       offset 32, scale d*sc, no zero        6-bit codes 0..63, per sub-block of 16 (the
                                                                    product exact: 11 x 8 mantissa bits)
(torch's int4 kernel takes (q - 8) * scale + zero': `zero_for_offset(8)` converts, rounding, for it alone.)
The 4-bit codes default to offset 8 (round_to_nearest's and torch's convention), the 8-bit ones to 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupQuantized:
    codes: torch.Tensor            # [N, K] uint8 (4- and 6-bit codes) or int8 (8-bit)
    scale: torch.Tensor            # [N, K // group] float32
    zero: torch.Tensor | None      # [N, K // group] float32, None for 0
    group: int
    bits: int                      # 4, 6 or 8
    exact: bool = True             # the file's own codes (False: re-rounded at load from another format)
    offset: int | None = None      # subtracted from the codes (None: 8 for 4-bit codes, 0 for 8-bit ones)
    # Q4_K's two levels as the file stores them, (fp16 super-scale [N, K // 256], uint8 multiplier [N, K // 32]):
    # scale == super * multiplier (and zero the same of -dmin and m), so kernels can hold 10 bits a group, not 32;
    # Q6_K's, (fp16 d [N, K // 256], int8 multiplier [N, K // 16])
    scale_parts: tuple[torch.Tensor, torch.Tensor] | None = None
    zero_parts: tuple[torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self):
        if self.offset is None:
            object.__setattr__(self, "offset", 8 if self.bits == 4 else 0)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def minimum(self) -> torch.Tensor:
        """Per group, the value of code 0: value = code * scale + minimum (what kvflow's kernels take)."""
        if self.offset == 0 and self.zero is not None:
            return self.zero
        zero = self.zero if self.zero is not None else torch.zeros_like(self.scale)
        return zero - self.offset * self.scale

    def zero_for_offset(self, offset: int) -> torch.Tensor:
        """The zero that gives the same values with the codes shifted by `offset` instead (rounded in float32)."""
        zero = self.zero if self.zero is not None else torch.zeros_like(self.scale)
        return zero if offset == self.offset else zero + (offset - self.offset) * self.scale

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.codes.shape
        q = self.codes.view(n, k // self.group, self.group).to(torch.float32)
        if self.offset:
            q -= self.offset
        w = q * self.scale[..., None]
        if self.zero is not None:
            w += self.zero[..., None]
        return w.view(n, k).to(dtype)

    def take_rows(self, index: torch.Tensor) -> "GroupQuantized":
        pick = lambda t: None if t is None else t[index]     # noqa: E731
        parts = lambda p: None if p is None else (p[0][index], p[1][index])     # noqa: E731
        return GroupQuantized(self.codes[index], self.scale[index], pick(self.zero), self.group, self.bits, self.exact,
                              self.offset, parts(self.scale_parts), parts(self.zero_parts))

    @staticmethod
    def cat(parts: list["GroupQuantized"]) -> "GroupQuantized":
        """Row-wise concatenation (fused q/k/v or gate/up); all parts share group and bits. Parts with different
        offsets (Q4_0's 8 beside Q4_K's 0) are brought to offset 0, their zeros then rounded: not exact."""
        first = parts[0]
        if any((p.group, p.bits, p.shape[1]) != (first.group, first.bits, first.shape[1]) for p in parts):
            raise ValueError("cannot stack group-quantized matrices of different formats")
        offsets = {p.offset for p in parts}
        offset = first.offset if len(offsets) == 1 else 0
        zeros = [p.zero_for_offset(offset) for p in parts]
        no_zero = all(p.zero is None for p in parts) and len(offsets) == 1

        def two_levels(field):
            if any(getattr(p, field) is None for p in parts):
                return None
            return tuple(torch.cat([getattr(p, field)[i] for p in parts]) for i in (0, 1))
        return GroupQuantized(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                              None if no_zero else torch.cat(zeros), first.group, first.bits,
                              all(p.exact for p in parts) and len(offsets) == 1, offset,
                              two_levels("scale_parts"), two_levels("zero_parts") if len(offsets) == 1 else None)

    @staticmethod
    def round_to_nearest(weight: torch.Tensor, bits: int = 4, group: int = 32) -> "GroupQuantized":
        """Float [N, K] -> codes by round to nearest: 4-bit asymmetric (each group's min..max over 16 levels,
        as Q4_1), 8-bit symmetric (absmax / 127, as Q8_0). K must be a multiple of `group`."""
        n, k = weight.shape
        if k % group:
            raise ValueError(f"{k} columns do not split into groups of {group}")
        w = weight.detach().float().reshape(n, k // group, group)
        if bits == 8:
            scale = (w.abs().amax(-1) / 127).clamp(min=1e-12)
            codes = (w / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
            return GroupQuantized(codes.view(n, k), scale, None, group, 8, exact=False)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        codes = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        return GroupQuantized(codes.view(n, k), scale, lo + 8 * scale, group, 4, exact=False)

    def resolve(self) -> "GroupQuantized":
        return self


class DeferredCodes:
    """A `GroupQuantized` matrix not read yet: the loader yields one per GGUF matrix it keeps as codes, holding only
    how to read and decode it (`decode`: the file's bytes are read then), and the quantization step calls it
    (`resolve`) when it builds that matrix's module. Why: decoded codes take a byte a weight (Q5_0, Q8_0) and were all resident at
    once between loading and quantizing, so a load peaked ~0.5 GiB above the steady state on a 0.5B model; one at
    a time, the peak is one matrix's. Row picks (`take_rows`: permuted or split rows) are deferred too."""

    def __init__(self, decode, shape: tuple[int, int]):
        self._decode = decode          # () -> GroupQuantized
        self.shape = tuple(shape)

    def resolve(self) -> GroupQuantized:
        return self._decode()

    def take_rows(self, index: torch.Tensor) -> "DeferredCodes":
        return DeferredCodes(lambda: self.resolve().take_rows(index), (len(index), self.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.resolve().dequantize(dtype)


CODES = (GroupQuantized, DeferredCodes)     # what a loaded matrix kept as codes may be
