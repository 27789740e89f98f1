"""Layout "x16", the one layout kvflow's linear kernels read (kernels/csrc/linear.c describes it byte by byte): weight
rows in blocks of 16 interleaved per register, codes of every format in groups of 32 columns, and the scales and
minimums beside them in the same row order, held as the file stores them (float32, fp16, or Q4_K's two levels) and
widened exactly by the kernels.
"""
from __future__ import annotations

import torch

GROUP = 32     # columns per group of codes (one scale each)
X16 = 16       # weight rows per block of the layout

# the forms a matrix's scales and minimums are held in (linear.c: `flags` bits 0-1 for d's, 2-3 for m's)
FLOAT32, FLOAT16, TWO_LEVELS = 0, 1, 2
MINUS_8_D = 3      # a minimum's form: not stored, -8 times d (GGUF Q4_0; `minimums_of` in the C)
PER_8_GROUPS = 3   # a d's form: fp16, one per 8 groups (Q6_K's d)
_FORMS = {torch.float32: FLOAT32, torch.float16: FLOAT16, torch.uint8: TWO_LEVELS}


def padded_rows(n: int) -> int:
    """Rows the layout holds for an [n, K] matrix (its kernels' output has this many columns)."""
    return -(-n // X16) * X16


def out_rows(codes: torch.Tensor) -> int:
    """The output columns of a matrix whose codes are in the layout ([N / 16, ...])."""
    return codes.shape[0] * X16


def interleave(codes: torch.Tensor, k: int) -> torch.Tensor:
    """[N, K] bytes -> [N / 16, G, 8 quads, 16 rows, 4 bytes], rows padded with zeros."""
    n = codes.shape[0]
    codes = torch.nn.functional.pad(codes, (0, 0, 0, padded_rows(n) - n))
    return codes.view(-1, X16, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4)


def quads_of_rows(packed: torch.Tensor, rows: torch.Tensor, registers: int) -> torch.Tensor:
    """Rows `rows` of a layout of `registers` 64-byte registers a group: [*rows, G, registers, 4 bytes]."""
    g = packed.shape[1]
    return packed.reshape(-1, g, registers, X16, 4)[rows // X16, :, :, rows % X16]


def pack_scales(t: torch.Tensor, compact: bool = False,
                parts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Per-group scales or minimums [N, G] float32 -> the layout, [N / 16, G, 16]. `compact`: held as the file stores
    them, which the kernels widen back to the same float32 values: `parts` (Q4_K's fp16 super-scale per 8 groups
    [N, G / 8] and uint8 multiplier [N, G], t == super * multiplier) as one uint8 buffer, the multipliers then the
    super-scales, each in the layout; else fp16 where every value is one (GGUF's own d and m are); else float32."""
    t = t.float()
    if compact and parts is not None:
        sup, mult = parts
        if t.shape[1] % 8 == 0 and torch.equal(sup.float().repeat_interleave(8, 1) * mult.float(), t):
            return torch.cat([scale_layout(mult.to(torch.uint8)).view(-1),
                              scale_layout(sup.half()).view(-1).view(torch.uint8)])
    if compact and torch.equal(t.half().float(), t):
        t = t.half()
    return scale_layout(t)


def scale_layout(t: torch.Tensor) -> torch.Tensor:
    """[N, G] of any dtype -> [N / 16, G, 16], rows padded with zeros."""
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


def scale_rows(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of per-group scales held in `pack_scales`'s layout [N / 16, G, 16]: [*ids, G]."""
    return t[ids // X16, :, ids % X16]


def minimums(minimum: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What a matrix holds as its minimums, `pack_scales`'d: nothing (an empty tensor, the kernels' form MINUS_8_D)
    where every one is -8 times its group's scale, as GGUF's Q4_0 defines them; else `minimum` as is."""
    same_form = minimum.dtype == scale.dtype != torch.uint8 and minimum.shape == scale.shape
    return minimum.new_empty(0) if same_form and torch.equal(minimum.float(), -8.0 * scale.float()) else minimum


def minimum_values(minimum: torch.Tensor, scale_values: torch.Tensor) -> torch.Tensor:
    """A matrix's minimums as float32 in the layout of `scale_values` (its widened scales), stored or not."""
    return -8.0 * scale_values if minimum.numel() == 0 else minimum.float()


def form_of(t: torch.Tensor, minimum: bool) -> int | None:
    """The form of held scales (or minimums): None for a dtype the kernels do not read."""
    return MINUS_8_D if minimum and t.numel() == 0 else _FORMS.get(t.dtype)


def scale_elements(form: int, groups: int) -> int:
    """Elements a scale array of this form holds for `groups` groups (two levels: 10 bits a group, as bytes)."""
    return {TWO_LEVELS: groups * 5 // 4, MINUS_8_D: 0}.get(form, groups)
