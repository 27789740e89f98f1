"""Paged attention in pure PyTorch.

New K/V are written into the cache by slot. Decodes (one query token each) are batched into one
scaled-dot-product call over their gathered blocks, padded and masked; each prefill chunk attends
to its past through its block table (or, with no past, directly to its own K/V).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.layers.quantization import to_float
from kvflow.layers.forward_context import get_attn_metadata

FP8_MAX = 448.0


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        # set by the model runner once the cache is allocated: [num_blocks, block_size, Hkv, D] each
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq*D]."""
        meta = get_attn_metadata()
        self._store(self.k_cache, meta.slot_mapping, k)
        self._store(self.v_cache, meta.slot_mapping, v)

        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q[:nd], meta)
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], p)
        return out.view(q.shape[0], -1)

    # A float8 cache (kv_cache_dtype="fp8") is written and gathered through a uint8 view: CPU torch has no
    # float8 index kernels. Values are stored unscaled (scale 1.0, as vLLM without calibration), clamped to
    # e4m3's range.
    @staticmethod
    def _store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        flat = cache.view(-1, *x.shape[1:])
        if cache.dtype == torch.float8_e4m3fn:
            flat.view(torch.uint8).index_copy_(0, slots, x.clamp(-FP8_MAX, FP8_MAX).to(cache.dtype).view(torch.uint8))
        else:
            flat.index_copy_(0, slots, x)

    @staticmethod
    def _load(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if cache.dtype == torch.float8_e4m3fn:
            return to_float(cache.view(torch.uint8)[blocks].view(cache.dtype), dtype)
        return cache[blocks]

    def _decode(self, q: torch.Tensor, meta) -> torch.Tensor:
        B, Hq, D = q.shape
        Hkv = self.num_kv_heads
        # [B, max_blocks, block_size, Hkv, D] -> [B, Hkv, L, D]
        keys = self._load(self.k_cache, meta.decode_block_tables, q.dtype).flatten(1, 2).transpose(1, 2)
        values = self._load(self.v_cache, meta.decode_block_tables, q.dtype).flatten(1, 2).transpose(1, 2)
        # grouped-query attention without repeating K/V: the group's heads act as query rows
        q = q.view(B, Hkv, Hq // Hkv, D)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.decode_key_mask, scale=self.scale)
        return o.reshape(B, Hq, D)

    def _prefill(self, q, k, v, p) -> torch.Tensor:
        past = p.context_len - p.q_len
        if past == 0:
            keys, values, mask, causal = k, v, None, True
        else:
            n_blocks = -(-p.context_len // self.k_cache.shape[1])
            keys = self._load(self.k_cache, p.block_table[:n_blocks], q.dtype).flatten(0, 1)[:p.context_len]
            values = self._load(self.v_cache, p.block_table[:n_blocks], q.dtype).flatten(0, 1)[:p.context_len]
            q_pos = torch.arange(past, p.context_len, device=q.device)
            mask = torch.arange(p.context_len, device=q.device)[None, :] <= q_pos[:, None]
            causal = False
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, is_causal=causal, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return o.transpose(0, 1)
