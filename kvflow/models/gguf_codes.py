"""GGUF blocks as codes and scales (`GroupQuantized`), the file's own values, for kvflow's kernels: split from
gguf_reader.py so that reading a GGUF's header (the server's frontend does, for the tokenizer) imports no torch.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from kvflow.kernels.group_quant import GroupQuantized


# ggml type id -> (bytes per block of 32, byte offset of the codes, has a min `m` after `d`, bits)
_GROUP_BLOCKS = {2: (18, 2, False, 4),      # Q4_0: d fp16, 16 bytes of nibbles; d * (q - 8)
                 3: (20, 4, True, 4),       # Q4_1: d fp16, m fp16, 16 bytes of nibbles; d * q + m
                 8: (34, 2, False, 8),      # Q8_0: d fp16, 32 int8; d * q
                 6: (22, 6, False, 5)}      # Q5_0: d fp16, qh (32 high bits), 16 bytes of nibbles; d * (q - 16)
Q4_K, Q4_K_BYTES = 12, 144                 # per 256 values: d, dmin fp16, 12 bytes of 6-bit sc/m, 128 of nibbles
Q6_K, Q6_K_BYTES = 14, 210                 # per 256 values: 128 bytes of low nibbles, 64 of top bit pairs, 16 int8
                                           # scales, d fp16


# values decoded at a time by `group_quantized_by_rows` (whole rows of them): the decode's temporaries (several times
# the codes' bytes) and the file's bytes are then a slice's, never a whole matrix's (a 151,936-row Q5_0 embedding's
# were ~0.6 GiB); small slices, as formats.PACK_VALUES's, so that glibc's heap reuses their temporaries
DECODE_VALUES = 1 << 21


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float32 (exact)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def keeps_codes(qtype: int, shape: tuple[int, ...]) -> bool:
    """`group_quantized` decodes this matrix (else: None)."""
    return len(shape) == 2 and (qtype in (Q4_K, Q6_K) or qtype in _GROUP_BLOCKS)


def group_quantized(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> GroupQuantized | None:
    """A Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q4_K / Q6_K matrix's blocks as codes and per-group scales (None for other types),
    codes untouched, every scale and zero the float32 value gguf's dequantize computes (group_quant.py's table):
    `.dequantize()` equals `dequantize(raw, ...)` bit for bit. Vectorized over all blocks.

    A Q4_0 / Q4_1 block's nibbles hold elements j (low) and j + 16 (high), as llama.cpp packs them; Q5_0 adds bit
    j of its 32-bit qh as element j's fifth bit and becomes 8-bit codes q - 16 (-16..15), scale d, which is
    exactly Q8_0's format. Q4_K (ggml's block_q4_K) is a group-32 4-bit asymmetric format once its two levels of
    scales are multiplied out: sub-block j of a block has scale d * sc[j] and minimum -(dmin * m[j]), and its
    codes are the low (j even) or high (j odd) nibbles of bytes 32 * (j // 2) .. + 31. Q6_K (block_q6_K) is a
    group-16 6-bit format: element e of a block is (q - 32) * (d * sc[e // 16]), q its nibble and top two bits as
    ggml's dequantize_row_q6_K places them."""
    if not keeps_codes(qtype, shape):
        return None
    n, k = shape
    if qtype == Q4_K:
        return _q4_k(torch.from_numpy(raw).view(n, k // 256, Q4_K_BYTES), n, k)
    if qtype == Q6_K:
        return _q6_k(torch.from_numpy(raw).view(n, k // 256, Q6_K_BYTES), n, k)
    block_bytes, codes_at, has_min, bits = _GROUP_BLOCKS[qtype]
    blocks = torch.from_numpy(raw).view(n, k // 32, block_bytes)
    d = _fp16(blocks[..., :2])
    qs = blocks[..., codes_at:]
    if bits == 8:
        return GroupQuantized(qs.contiguous().view(torch.int8).reshape(n, k), d, None, 32, 8)
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)
    if bits == 5:
        qh = blocks[..., 2:6]                                                       # little-endian uint32
        high = (qh[..., :, None] >> torch.arange(8, dtype=torch.uint8)) & 1          # [n, g, 4 bytes, 8 bits]
        codes = (codes | (high.reshape(n, k // 32, 32) << 4)).view(torch.int8) - 16
        return GroupQuantized(codes.reshape(n, k), d, None, 32, 8)
    if has_min:
        return GroupQuantized(codes.reshape(n, k), d, _fp16(blocks[..., 2:4]), 32, 4, offset=0)
    return GroupQuantized(codes.reshape(n, k), d, None, 32, 4)


def group_quantized_by_rows(read, qtype: int, shape: tuple[int, ...]) -> GroupQuantized | None:
    """`group_quantized` of a matrix whose bytes `read((start, stop))` gives a slice of rows at a time: the rows of
    DECODE_VALUES values are read and decoded at once, into the result's tensors allocated once (rows decode on their
    own: the same codes and scales, bit for bit). Held besides the result: one slice's bytes and temporaries."""
    if not keeps_codes(qtype, shape):
        return None
    n, k = shape
    step = max(1, DECODE_VALUES // k)
    first = group_quantized(read((0, min(n, step))), qtype, (min(n, step), k))
    if n <= step:
        return first

    def whole(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        out = torch.empty((n, *t.shape[1:]), dtype=t.dtype)
        out[:step] = t
        return out

    pairs = lambda p: None if p is None else tuple(whole(t) for t in p)     # noqa: E731
    codes = replace(first, codes=whole(first.codes), scale=whole(first.scale), zero=whole(first.zero),
                    scale_parts=pairs(first.scale_parts), zero_parts=pairs(first.zero_parts))
    held = _tensors(codes)
    del first
    for start in range(step, n, step):
        stop = min(n, start + step)
        part = group_quantized(read((start, stop)), qtype, (stop - start, k))
        for out, t in zip(held, _tensors(part)):
            out[start:stop] = t
    return codes


def _tensors(codes: GroupQuantized) -> list[torch.Tensor]:
    """Every per-row tensor of `codes`, in one order."""
    parts = [*(codes.scale_parts or ()), *(codes.zero_parts or ())]
    return [t for t in (codes.codes, codes.scale, codes.zero, *parts) if t is not None]


def _q4_k(blocks: torch.Tensor, n: int, k: int) -> GroupQuantized:
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])                     # [n, k / 256]
    s = blocks[..., 4:16]
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]        # ggml's get_scale_min_k4: 6-bit sc and m of 8 sub-blocks
    sc = torch.cat([a & 63, (c & 15) | ((a >> 2) & 48)], dim=-1)                  # [n, k / 256, 8] uint8
    m = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 48)], dim=-1)
    qs = blocks[..., 16:].reshape(n, k // 256, 4, 1, 32)
    codes = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, k)                     # sub-block 2c low, 2c + 1 high
    scale = (d[..., None] * sc.float()).reshape(n, k // 32)
    minimum = (-(dmin[..., None] * m.float())).reshape(n, k // 32)                  # d*sc*q + (-(dmin*m)): gguf's
    return GroupQuantized(codes, scale, minimum, 32, 4, offset=0, scale_parts=(d, sc.reshape(n, k // 32)),
                          zero_parts=(-dmin, m.reshape(n, k // 32)))


def _q6_k(blocks: torch.Tensor, n: int, k: int) -> GroupQuantized:
    # each half of a block (128 values): 64 bytes ql, 32 bytes qh; value 32j + l of the half (j = 0..3, l = 0..31)
    # has the low (j < 2) or high nibble of ql[l + 32 * (j % 2)] and bits 2j, 2j + 1 of qh[l]
    ql = blocks[..., :128].reshape(n, k // 256, 2, 2, 32)
    qh = blocks[..., 128:192].reshape(n, k // 256, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=3)                                        # [n, blocks, half, j, l]
    top = (qh >> (2 * torch.arange(4, dtype=torch.uint8))[:, None]) & 3
    codes = (low | (top << 4)).reshape(n, k)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).reshape(n, k // 16)
    d = _fp16(blocks[..., 208:210])                                                   # [n, k / 256]
    scale = (d.repeat_interleave(16, 1) * sc.float())                                 # d * sc: exact in float32
    return GroupQuantized(codes, scale, None, 16, 6, offset=32, scale_parts=(d, sc))
