"""The table of weight formats kvflow's linear kernels multiply: one row (a `WeightFormat`) per code width, each
saying how a matrix of group-quantized codes (`GroupQuantized`: what a GGUF's blocks become) is held in layout x16,
how its scales are held, how to read rows back (embedding lookups from an LM head's own codes), which codes it
takes, and how to check its kernel on this machine.

The C side knows a format by its code width alone: the block kernels are specialized per width
(kernels/csrc/linear_x16_avx512.c, linear_x16_avx2.c), and each row's bytes per block of 16 rows over one group are
registered with the library at load (build.py). So a new weight format is a row here, its case in each of the two
block kernels, its block in the GGUF reader (models/gguf_codes.py) and a test; everything else (the torch operator,
the modules, stacked experts, the native decoder step) reads it from this table.

  width  what it holds                                      value                                   bytes / weight
  4      GGUF Q4_0 / Q4_1 / Q4_K, int4                      code * d + m                            0.5 (+ scales)
  5      GGUF Q5_0 (8-bit codes in -16..15)                 (code - 16) * d                         0.625
  6      GGUF Q6_K, its int8 multiplier per 16 columns      (code - 32) * sc * d, d per 256         0.8125
  8      GGUF Q8_0, K-quants re-rounded to 8 bits           code * d                                1
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from kvflow.kernels import layout
from kvflow.kernels.layout import GROUP, X16

if TYPE_CHECKING:
    from kvflow.kernels.group_quant import GroupQuantized


class WeightFormat:
    """One row of the table. `group_bytes`: bytes of one block of 16 rows over one group of 32 columns."""

    name: str
    bits: int
    group_bytes: int
    has_minimum = False            # value = code * d + m (the 4-bit codes)

    def accepts(self, codes: GroupQuantized) -> bool:
        """These codes are held exactly in this format."""
        raise NotImplementedError

    def pack(self, codes: GroupQuantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scales, minimums) in the layout, scales as the file stores them; minimums an empty float32 tensor
        where the format has none (or where they are -8 d, layout.MINUS_8_D)."""
        raise NotImplementedError

    def row_values(self, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, ids: torch.Tensor,
                   n: int) -> torch.Tensor:
        """The float32 values of rows `ids` of an [n, K] matrix held in this format: the file's values exactly."""
        raise NotImplementedError

    def code_bytes(self, n: int, k: int) -> int:
        """Bytes of an [n (padded), k] matrix's codes in the layout."""
        return n * (k // GROUP) * self.group_bytes // X16

    def scale_forms(self, scale: torch.Tensor, minimum: torch.Tensor) -> list[int | None]:
        """The forms of the held scales (and minimums, for a format that has them); None: not a form it reads."""
        forms = [layout.form_of(scale, False)]
        return forms + [layout.form_of(minimum, True)] if self.has_minimum else forms

    def scales_fit(self, n: int, k: int, elements: list[int], forms: list[int]) -> bool:
        """Whether held scales of these element counts and forms belong to an [n (padded), k] matrix."""
        groups = n * (k // GROUP)
        return (all(e == layout.scale_elements(f, groups) for e, f in zip(elements, forms))
                and not (layout.TWO_LEVELS in forms and (k // GROUP) % 8))

    def self_check(self, run, g: torch.Generator) -> bool:
        """This machine's kernel for the format against torch on random weights (`run(x, codes, scale, minimum)`:
        the kernel), within what int8 activations explain (~1% of the output's scale)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<weight format {self.name}: {self.bits}-bit codes>"


# values packed at a time (a multiple of X16 rows of them): packing builds temporaries several times the codes' size
# (int32 ones for Q5 / Q6), which for a whole 248,320-row vocabulary (Qwen3.5's tied Q6_K table) peaked at ~4 GiB
# while loading; a slice's stay a few MiB, which glibc's heap reuses (8192 rows of 896 left ~0.1 GiB more of it
# behind; 2048 rows of LFM2's 8192-wide ffn_down, ~0.1 GiB of temporaries each)
PACK_VALUES = 1 << 21


def _by_row_chunks(pack_rows, *rows: torch.Tensor) -> torch.Tensor:
    """`pack_rows(*rows)` (codes in the layout x16, row blocks first) computed PACK_VALUES values at a time into the
    result, allocated once: each chunk's row blocks are the whole matrix's, so the result is the same bytes, and
    only one chunk's temporaries are held besides it."""
    n, k = rows[0].shape
    step = max(X16, PACK_VALUES // k // X16 * X16)
    if n <= step:
        return pack_rows(*rows)
    out, at = None, 0
    for a in range(0, n, step):
        part = pack_rows(*(t[a:a + step] for t in rows))
        if out is None:
            out = torch.empty((layout.padded_rows(n) // X16, *part.shape[1:]), dtype=part.dtype)
        out[at:at + part.shape[0]] = part
        at += part.shape[0]
    return out


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got, want, rtol=0, atol=0.02 * want.abs().max().item())


class Q4(WeightFormat):
    """4-bit codes 0..15 (one per byte, as `GroupQuantized` holds them), value = code * d + m per group of 32. x16
    [N / 16, G, 4, 64]: register c holds quad c in its low nibbles and quad c + 4 in its high ones. Q4_0's minimums
    (-8 d) are not stored; Q4_K's d and m are held as its two levels (fp16 per 256, 6-bit multiplier per 32)."""

    name, bits, group_bytes, has_minimum = "q4", 4, 4 * 64, True

    def accepts(self, codes: GroupQuantized) -> bool:
        return codes.bits == 4 and codes.group == GROUP and codes.shape[1] % GROUP == 0

    def pack(self, codes: GroupQuantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # scales as the file stores them: fp16 (GGUF's d and m, Q4_0's -8d), or Q4_K's fp16 d per 256 and 6-bit sc
        # per 32; float32 otherwise. The kernel widens them exactly, so the results are the same bits either way
        scale = layout.pack_scales(codes.scale, compact=True, parts=codes.scale_parts)
        minimum_parts = codes.zero_parts if codes.offset == 0 else None
        minimum = layout.minimums(layout.pack_scales(codes.minimum(), compact=True, parts=minimum_parts), scale)
        return self.pack_codes(codes.codes), scale, minimum

    @staticmethod
    def pack_codes(codes: torch.Tensor) -> torch.Tensor:
        return _by_row_chunks(Q4._pack_rows, codes)

    @staticmethod
    def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
        k = codes.shape[1]
        quads = layout.interleave(codes.to(torch.uint8), k).reshape(-1, k // GROUP, 2, 4, 64)
        return (quads[:, :, 0] | (quads[:, :, 1] << 4)).contiguous()

    @staticmethod
    def unpack_codes(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """`pack_codes`'s inverse: codes [n, k] (padding rows dropped)."""
        quads = torch.stack([packed & 15, packed >> 4], 2).view(-1, k // GROUP, 8, X16, 4)
        return quads.permute(0, 3, 1, 2, 4).reshape(-1, k)[:n]

    def row_values(self, packed, scale, minimum, ids, n):
        g = packed.shape[1]
        quads = layout.quads_of_rows(packed, ids, 4)                              # low nibbles quads 0..3, high 4..7
        codes = torch.cat([quads & 15, quads >> 4], dim=-2).reshape(*ids.shape, g, GROUP).to(torch.float32)
        scales = layout.widen_scales(scale, n, g)
        minimums = layout.minimum_values(layout.widen_scales(minimum, n, g), scales)
        scales, minimums = (layout.scale_rows(t, ids)[..., None] for t in (scales, minimums))
        return (codes * scales + minimums).view(*ids.shape, g * GROUP)

    def self_check(self, run, g):
        n, k = 40, 96
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = torch.rand(n, k // GROUP, generator=g) * 0.1
        w = (codes.float().view(n, -1, GROUP) * scale[..., None] - 8 * scale[..., None]).view(n, k)
        packed = (self.pack_codes(codes), layout.pack_scales(scale), layout.pack_scales(-8 * scale))
        return all(_close(run(x, *packed)[:, :n], x @ w.T) for x in (torch.randn(r, k, generator=g) for r in (1, 5, 70)))


class Q8(WeightFormat):
    """8-bit codes -128..127, value = code * d per group of 32. x16 [N / 16, G, 8, 64] of code + 128 (vpdpbusd wants
    its weight operand unsigned)."""

    name, bits, group_bytes = "q8", 8, 8 * 64

    def accepts(self, codes: GroupQuantized) -> bool:
        return codes.bits == 8 and codes.group == GROUP and codes.zero is None

    def pack(self, codes: GroupQuantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.pack_codes(codes.codes), layout.pack_scales(codes.scale, compact=True),     # Q8_0's fp16 d
                torch.empty(0))

    def pack_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return _by_row_chunks(self._pack_rows, codes)

    @staticmethod
    def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
        k = codes.shape[1]
        return (layout.interleave(codes.view(torch.uint8), k) ^ 0x80).reshape(-1, k // GROUP, 8, 64).contiguous()

    def int8_rows(self, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the codes as int8 [*ids, K] (value = code * its group's d)."""
        quads = layout.quads_of_rows(packed, ids, 8)
        return (quads ^ 0x80).view(torch.int8).reshape(*ids.shape, packed.shape[1] * GROUP)

    def row_values(self, packed, scale, minimum, ids, n):
        codes = self.int8_rows(packed, ids).to(torch.float32).view(*ids.shape, -1, GROUP)
        return (codes * layout.scale_rows(scale, ids).float()[..., None]).flatten(-2)

    def self_check(self, run, g):
        n, k = 40, 96
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, k // GROUP, generator=g) * 0.1
        w = (codes.float().view(n, -1, GROUP) * scale[..., None]).view(n, k)
        packed = (self.pack_codes(codes), layout.pack_scales(scale), torch.empty(0))
        return all(_close(run(x, *packed)[:, :n], x @ w.T) for x in (torch.randn(r, k, generator=g) for r in (1, 5, 70)))


class Q5(Q8):
    """8-bit codes that are 5-bit ones (-16..15: Q5_0's q - 16), held in 5/8 of the bytes: x16 [N / 16, G, 5, 64] of
    code + 16, 4-bit's four registers of nibbles, then one whose byte (row, column c % 4 of a quad) holds in bit q the
    fifth bit of quad q. Its kernel's integer sums are the 8-bit kernel's on the same codes: the same bits."""

    name, bits, group_bytes = "q5", 5, 5 * 64

    def accepts(self, codes: GroupQuantized) -> bool:
        return super().accepts(codes) and self.fits(codes.codes)

    @staticmethod
    def fits(codes: torch.Tensor) -> bool:
        return codes.dtype == torch.int8 and codes.numel() > 0 and -16 <= int(codes.min()) and int(codes.max()) <= 15

    def pack_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return _by_row_chunks(self._pack_rows, codes)

    @staticmethod
    def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
        k = codes.shape[1]
        u = (codes.to(torch.int16) + 16).to(torch.uint8)
        nibbles, high = Q4.pack_codes(u & 15), u >> 4
        quads = layout.interleave(high, k).reshape(-1, k // GROUP, 8, 64).to(torch.int32)    # [blocks, G, quad, 64]
        bits = (quads << torch.arange(8, dtype=torch.int32)[:, None]).sum(2).to(torch.uint8)
        return torch.cat([nibbles, bits[:, :, None]], dim=2).contiguous()

    def int8_rows(self, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        regs = layout.quads_of_rows(packed, ids, 5)                                  # [*ids, G, 5, 4]
        nib = torch.cat([regs[..., :4, :] & 15, regs[..., :4, :] >> 4], dim=-2)       # quads 0..7
        high = (regs[..., 4:, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
        u = nib | (high << 4)
        return (u.to(torch.int16) - 16).to(torch.int8).reshape(*ids.shape, packed.shape[1] * GROUP)

    def self_check(self, run, g):
        n, k = 40, 96
        codes = torch.randint(-16, 16, (n, k), generator=g, dtype=torch.int8)
        scale = layout.pack_scales(torch.rand(n, k // GROUP, generator=g) * 0.1)
        eight, none = FORMATS[8], torch.empty(0)
        return all(torch.equal(run(x, self.pack_codes(codes), scale, none),
                               run(x, eight.pack_codes(codes), scale, none, bits=8))
                   for x in (torch.randn(r, k, generator=g) for r in (1, 5, 70)))


class Q6(WeightFormat):
    """Q6_K as the file holds it: 6-bit codes 0..63 with an int8 multiplier per 16 columns and fp16 d per 256, value
    (code - 32) * multiplier * d. x16 [N / 16, G, 13, 32] bytes a group: 4-bit's four registers of nibbles, two
    whose byte (row, column c % 4 of a quad) holds the top two bits of quads 0..3 (4..7) in bits 2q, 2q + 1, then the
    16 rows' multipliers of the group's first 16 columns and of its last 16; d [N / 16, G / 8, 16]."""

    name, bits, group_bytes = "q6", 6, 6 * 64 + 2 * X16

    def accepts(self, codes: GroupQuantized) -> bool:
        return codes.bits == 6 and codes.scale_parts is not None and codes.shape[1] % 256 == 0

    def pack(self, codes: GroupQuantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d, multipliers = codes.scale_parts
        return self.pack_codes(codes.codes, multipliers), self.pack_d(d), torch.empty(0)

    def pack_codes(self, codes: torch.Tensor, multipliers: torch.Tensor) -> torch.Tensor:
        return _by_row_chunks(self._pack_rows, codes, multipliers)

    def _pack_rows(self, codes: torch.Tensor, multipliers: torch.Tensor) -> torch.Tensor:
        n, k = codes.shape
        g = k // GROUP
        u = codes.to(torch.uint8)
        nibbles = Q4.pack_codes(u & 15)                                                  # [blocks, G, 4, 64]
        high = layout.interleave(u >> 4, k).reshape(-1, g, 2, 4, 64).to(torch.int32)     # [blocks, G, reg, quad, 64]
        tops = (high << (2 * torch.arange(4, dtype=torch.int32))[:, None]).sum(3).to(torch.uint8)
        mult = torch.nn.functional.pad(multipliers.view(torch.uint8), (0, 0, 0, layout.padded_rows(n) - n))
        mult = mult.view(-1, X16, g, 2).permute(0, 2, 3, 1).reshape(-1, g, 2 * X16)   # [blocks, G, half x 16 rows]
        packed = torch.cat([nibbles.view(-1, g, 256), tops.view(-1, g, 128), mult], dim=2)
        return packed.view(-1, g, self.group_bytes // 32, 32).contiguous()

    @staticmethod
    def pack_d(d: torch.Tensor) -> torch.Tensor:
        """d, fp16 [N, K / 256] (one per 8 groups: a Q6_K block) -> the layout [N / 16, G / 8, 16]."""
        return layout.scale_layout(d.half())

    def int8_rows(self, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the codes less 32, as int8 [*ids, K] (value = code * multiplier * d)."""
        return self.rows_of(packed, ids)[0]

    def rows_of(self, packed: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `ids`: (codes - 32 as int8 [*ids, K], multipliers int8 [*ids, K / 16])."""
        g = packed.shape[1]
        flat = packed.view(-1, g, self.group_bytes)
        regs = flat[:, :, :384].reshape(-1, g, 6, X16, 4)[ids // X16, :, :, ids % X16]     # [*ids, G, 6, 4]
        nib = torch.cat([regs[..., :4, :] & 15, regs[..., :4, :] >> 4], dim=-2)          # quads 0..7
        shifts = (2 * torch.arange(4, dtype=torch.uint8))[:, None]
        top = torch.cat([(regs[..., 4:5, :] >> shifts) & 3, (regs[..., 5:6, :] >> shifts) & 3], dim=-2)
        codes = ((nib | (top << 4)).to(torch.int16) - 32).to(torch.int8).reshape(*ids.shape, g * GROUP)
        mult = flat[:, :, 384:].reshape(-1, g, 2, X16)[ids // X16, :, :, ids % X16]       # [*ids, G, 2]
        return codes, mult.view(torch.int8).reshape(*ids.shape, 2 * g)

    def row_values(self, packed, scale, minimum, ids, n):
        codes, multipliers = self.rows_of(packed, ids)
        # code * (d * multiplier), d per 16 multipliers (per 256 columns)
        scales = layout.scale_rows(scale, ids).float().repeat_interleave(16, -1) * multipliers.float()
        return (codes.to(torch.float32).view(*ids.shape, -1, 16) * scales[..., None]).flatten(-2)

    def scale_forms(self, scale, minimum):
        return [layout.PER_8_GROUPS if scale.dtype == torch.float16 else None]

    def scales_fit(self, n, k, elements, forms):
        return k % (8 * GROUP) == 0 and elements == [n * (k // GROUP) // 8]         # d per 8 groups

    def self_check(self, run, g):
        n = 40          # over two blocks of 256
        codes = torch.randint(0, 64, (n, 512), generator=g, dtype=torch.uint8)
        mult = torch.randint(-128, 128, (n, 32), generator=g, dtype=torch.int8)
        d = (torch.rand(n, 2, generator=g) * 0.001).half()
        scale = d.float().repeat_interleave(16, 1) * mult.float()
        w = ((codes.float() - 32).view(n, -1, 16) * scale[..., None]).view(n, 512)
        x = torch.randn(7, 512, generator=g)
        return _close(run(x, self.pack_codes(codes, mult), self.pack_d(d), torch.empty(0))[:, :n], x @ w.T)


# narrowest first: `format_of` takes the first row that holds the codes exactly
FORMATS: dict[int, WeightFormat] = {f.bits: f for f in (Q4(), Q5(), Q6(), Q8())}


def format_of(codes: GroupQuantized) -> WeightFormat | None:
    """The format that holds these codes exactly, or None (then they are not kvflow's kernels' to multiply)."""
    return next((f for f in FORMATS.values() if f.accepts(codes)), None)


def linear_flags(fmt: WeightFormat, codes: torch.Tensor, k: int, scale: torch.Tensor, minimum: torch.Tensor) -> int:
    """The kernels' `flags` for these scales (bits 0-1: d's form, 2-3: m's), after checking that codes and scales
    are one layout of an [out rows, k] matrix in `fmt`: a kernel never reads past them."""
    n = layout.out_rows(codes)
    held = [scale, minimum] if fmt.has_minimum else [scale]
    forms = fmt.scale_forms(scale, minimum)
    if None in forms or not all(t.is_contiguous() for t in (codes, *held)):
        raise ValueError("native kernel: scales must be contiguous float32, float16 or pack_scales' two levels")
    if (k % GROUP or codes.numel() != fmt.code_bytes(n, k)
            or not fmt.scales_fit(n, k, [t.numel() for t in held], forms)):
        raise ValueError("native kernel: weights and scales not in one layout of this shape")
    return sum(f << (2 * i) for i, f in enumerate(forms))


def run_linear(lib: ctypes.CDLL, bits: int, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
               minimum: torch.Tensor, threads: int) -> torch.Tensor:
    """x [..., K] float32 @ W.T for W held in format FORMATS[bits]: [..., padded rows] float32."""
    fmt = FORMATS[bits]
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    n = layout.out_rows(codes)
    flags = linear_flags(fmt, codes, k, scale, minimum)
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    if rows.shape[0]:
        err = lib.kvflow_x16_linear(bits, rows.data_ptr(), rows.shape[0], k, codes.data_ptr(), scale.data_ptr(),
                                    minimum.data_ptr() if fmt.has_minimum else None, n, y.data_ptr(), threads,
                                    flags, 1)
        if err == 2:
            raise ValueError(f"native kernel: {bits}-bit codes are not a format it was built with")
        if err:
            raise MemoryError("native kernel: out of memory for its int8 activations")
    return y.view(*x.shape[:-1], n)


def register_and_check(lib: ctypes.CDLL) -> bool:
    """Tells the library every row's block bytes, then checks each row's kernel on this machine (its `isa()`'s
    instructions; odd row counts and a row count that is not a multiple of 16 included)."""
    for fmt in FORMATS.values():
        if lib.kvflow_x16_set_format(fmt.bits, fmt.group_bytes):
            return False
    g = torch.Generator().manual_seed(0)
    for fmt in FORMATS.values():
        def run(x, codes, scale, minimum, bits=fmt.bits):
            return run_linear(lib, bits, x, codes, scale, minimum, torch.get_num_threads())
        if not fmt.self_check(run, g):
            return False
    return True
