"""A weight matrix as integer codes with a scale and zero per group of columns: what a GGUF's Q4_0 / Q4_1 / Q8_0
blocks are, and what torch's int4 kernel multiplies.

value[n, k] = (code[n, k] - offset) * scale[n, g] + zero[n, g], g = k // group, offset 8 for 4-bit codes
(0..15) and 0 for 8-bit ones (-128..127). That is torch's int4 convention ((q - 8) * scale + zero), into which
every GGUF 4-bit block maps without touching the codes: Q4_0's d * (q - 8) is scale d, zero 0; Q4_1's
d * q + m is scale d, zero m + 8d. Kept in float32 here, so `dequantize` gives the file's own float32 values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupQuantized:
    codes: torch.Tensor            # [N, K] uint8 (4-bit codes) or int8 (8-bit)
    scale: torch.Tensor            # [N, K // group] float32
    zero: torch.Tensor | None      # [N, K // group] float32, None for 0
    group: int
    bits: int                      # 4 or 8
    exact: bool = True             # the file's own codes (False: re-rounded at load from another format)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def offset(self) -> int:
        return 8 if self.bits == 4 else 0

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
        return GroupQuantized(self.codes[index], self.scale[index], pick(self.zero), self.group, self.bits, self.exact)

    @staticmethod
    def cat(parts: list["GroupQuantized"]) -> "GroupQuantized":
        """Row-wise concatenation (fused q/k/v or gate/up); all parts share group and bits."""
        first = parts[0]
        if any((p.group, p.bits, p.shape[1]) != (first.group, first.bits, first.shape[1]) for p in parts):
            raise ValueError("cannot stack group-quantized matrices of different formats")
        zeros = [p.zero if p.zero is not None else torch.zeros_like(p.scale) for p in parts]
        return GroupQuantized(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                              None if all(p.zero is None for p in parts) else torch.cat(zeros),
                              first.group, first.bits, all(p.exact for p in parts))

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
