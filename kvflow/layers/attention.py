"""Paged attention in pure PyTorch.

New K/V are written into the cache by slot. Decodes (one query token each) are batched into one
scaled-dot-product call over their gathered blocks, padded and masked; each prefill chunk attends
to its past through its block table (or, with no past, directly to its own K/V).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.runner.forward_context import get_attn_metadata


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
        Hkv, D = self.num_kv_heads, self.head_dim
        flat_k = self.k_cache.view(-1, Hkv, D)
        flat_v = self.v_cache.view(-1, Hkv, D)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q[:nd], meta)
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], p)
        return out.view(q.shape[0], -1)

    def _decode(self, q: torch.Tensor, meta) -> torch.Tensor:
        B, Hq, D = q.shape
        Hkv = self.num_kv_heads
        # [B, max_blocks, block_size, Hkv, D] -> [B, Hkv, L, D]
        keys = self.k_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
        values = self.v_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
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
            keys = self.k_cache[p.block_table[:n_blocks]].flatten(0, 1)[:p.context_len]
            values = self.v_cache[p.block_table[:n_blocks]].flatten(0, 1)[:p.context_len]
            q_pos = torch.arange(past, p.context_len, device=q.device)
            mask = torch.arange(p.context_len, device=q.device)[None, :] <= q_pos[:, None]
            causal = False
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, is_causal=causal, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return o.transpose(0, 1)
