"""The int8 KV cache's rows (--kv-cache-dtype int8): each (token, KV head) row of D values is stored as D int8
codes and, in the 4 bytes after them, its float32 scale (absmax / 127), so a row is D + 4 bytes against 2 D for a
16-bit cache and 4 D for float32. A scale per row, not per block: a block's rows arrive one decode step at a
time, and a per-block scale fixed by its first row would clip every later, larger one.

value = code * scale. kvflow's attention kernel reads the codes and applies each row's scale after its dot product
(kernels/csrc/attention.c); the torch path dequantizes the rows it gathers (`dequantize_rows`). Both give the same
values; the kernel's sums differ from torch's only in order."""
from __future__ import annotations

import torch

SCALE_BYTES = 4


def row_bytes(head_dim: int) -> int:
    return head_dim + SCALE_BYTES


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] floats -> [..., D + 4] int8: the codes, then the scale's float32 bytes."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-30)
    codes = (x / scale).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([codes, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 -> [..., D] in `dtype`."""
    codes = rows[..., :-SCALE_BYTES]
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (codes.float() * scale).to(dtype)
