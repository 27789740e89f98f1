"""Paged attention in pure PyTorch.

New K/V are written into the cache by slot. Decodes (one query token each) are one scaled-dot-product call
over their blocks, gathered with one `index_select` per layer and padded to the longest (masked). All prefill
chunks of the step are one more call: their queries and their keys (read back from the cache, so a chunk with a
past is no special case) padded into a [chunks, length] batch under an offset-causal mask. The runner builds
the index tensors and masks once per step (`AttentionMetadata`); no layer loops over sequences.

Gathers use `index_select`, not `cache[block_tables]`: advanced indexing enters an OpenMP parallel region even
for a few KiB, which cost ~15 ms per call on this project's 2-core machine when other processes held the cores
(index_select stays serial at this size: 2.5 us). See docs/performance.md.

Sliding-window layers (`sliding_window` W: Gemma 3's local layers, Mistral, Phi-3) attend to keys p - W + 1 .. p
only: the same calls under the step's sliding masks (`decode_mask_sliding`, `PrefillBatch.mask_sliding`, built
with the others), or kvflow's kernel with its window argument. The cache keeps every position's K/V (prefix-cache
hits and chunked prefill read them back as for any layer).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels import ops
from kvflow.layers import kv_int8
from kvflow.layers.quantization import to_float
from kvflow.layers.attention_metadata import AttentionMetadata, PrefillBatch

FP8_MAX = 448.0
FP16_MAX = 65504.0


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window or 0      # 0: every key up to the query's position
        # set by the model runner once the cache is allocated: [num_blocks, block_size, Hkv, D] each
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq*D]."""
        self._store(self.k_cache, meta.slot_mapping, k)
        self._store(self.v_cache, meta.slot_mapping, v)

        nd = meta.num_decode_tokens
        if meta.seq_tables is not None:
            out = ops.paged_attention(q, self.k_cache, self.v_cache, meta.seq_tables, meta.row_seq,
                                                 meta.positions, self.scale, self.sliding_window)
        elif meta.prefill is None:
            out = self._decode(q, meta)
        elif nd == 0:
            out = self._prefill(q, k, v, meta.prefill)
        else:
            out = torch.cat([self._decode(q[:nd], meta), self._prefill(q[nd:], k[nd:], v[nd:], meta.prefill)])
        return out.reshape(q.shape[0], -1)

    # The cache may hold another element type than the compute dtype (platform.pick_kv_dtype): values are
    # converted on the way in and out. A float8 cache (kv_cache_dtype="fp8") is written and gathered through a
    # uint8 view: CPU torch has no float8 index kernels; its values are stored unscaled (scale 1.0, as vLLM without
    # calibration), clamped to e4m3's range. A float16 cache clamps to fp16's range (an inf would poison the
    # softmax). An int8 cache holds rows of codes and their scale (layers/kv_int8.py).
    @staticmethod
    def _store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        if cache.dtype == torch.int8:
            x = kv_int8.quantize_rows(x)
        elif cache.dtype == torch.float16 and x.dtype != torch.float16:
            x = x.clamp(-FP16_MAX, FP16_MAX)
        flat = cache.view(-1, *x.shape[1:])
        if cache.dtype == torch.float8_e4m3fn:
            flat.view(torch.uint8).index_copy_(0, slots, x.clamp(-FP8_MAX, FP8_MAX).to(cache.dtype).view(torch.uint8))
        else:
            flat.index_copy_(0, slots, x.to(cache.dtype))

    @staticmethod
    def _load(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, per: str) -> torch.Tensor:
        """Rows of the cache by block id (per="block": [n, block_size, Hkv, D]) or by slot ([n, Hkv, D]), in
        `dtype`."""
        rows = cache if per == "block" else cache.view(-1, *cache.shape[2:])
        if cache.dtype == torch.float8_e4m3fn:
            return to_float(rows.view(torch.uint8).index_select(0, index).view(cache.dtype), dtype)
        if cache.dtype == torch.int8:
            return kv_int8.dequantize_rows(rows.index_select(0, index), dtype)
        return rows.index_select(0, index).to(dtype)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        B, Hq, D = q.shape
        Hkv = self.num_kv_heads
        blocks = meta.decode_block_tables.flatten()
        # [B * max_blocks, block_size, Hkv, D] -> [B, Hkv, L, D]
        keys = self._load(self.k_cache, blocks, q.dtype, "block").view(B, -1, Hkv, D).transpose(1, 2)
        values = self._load(self.v_cache, blocks, q.dtype, "block").view(B, -1, Hkv, D).transpose(1, 2)
        # grouped-query attention without repeating K/V: the group's heads act as query rows
        q = q.view(B, Hkv, Hq // Hkv, D)
        mask = meta.decode_mask
        if self.sliding_window and meta.decode_mask_sliding is not None:
            mask = meta.decode_mask_sliding
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        return o.reshape(B, Hq, D)

    def _prefill(self, q, k, v, p: PrefillBatch) -> torch.Tensor:
        gqa = self.num_heads != self.num_kv_heads
        sliding = self.sliding_window and p.mask_sliding is not None
        if p.mask is None:      # one chunk and no past: its own K/V, causal (no mask to build or read)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               attn_mask=p.mask_sliding[0] if sliding else None,
                                               is_causal=not sliding, scale=self.scale, enable_gqa=gqa)
            return o.transpose(0, 1)
        P, Lq, Lk, D = p.num_seqs, p.max_q_len, p.max_context_len, self.head_dim
        queries = q.index_select(0, p.query_rows).view(P, Lq, self.num_heads, D).transpose(1, 2)
        keys = self._load(self.k_cache, p.key_slots, q.dtype, "slot").view(P, Lk, -1, D).transpose(1, 2)
        values = self._load(self.v_cache, p.key_slots, q.dtype, "slot").view(P, Lk, -1, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=p.mask_sliding if sliding else p.mask,
                                           scale=self.scale, enable_gqa=gqa)
        return o.transpose(1, 2).reshape(P * Lq, self.num_heads, D).index_select(0, p.output_rows)
