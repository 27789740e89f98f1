"""The per-step attention metadata, reachable from every attention layer without threading it through
every forward signature. The only module-level mutable state in kvflow (DESIGN rule)."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    """One sequence computing more than one token this step (a prompt or a prompt chunk)."""
    q_start: int          # first row of its tokens in the flat batch
    q_len: int
    context_len: int      # tokens in the cache after this step (past + new)
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [num_tokens] flat cache slot of each new token
    num_decode_tokens: int                # the first rows of the batch are decodes, one token each
    decode_block_tables: torch.Tensor | None = None   # [num_decodes, max_blocks]
    decode_key_mask: torch.Tensor | None = None       # [num_decodes, 1, 1, max_blocks*block_size] bool
    prefills: list[PrefillSeq] = field(default_factory=list)


_attn_metadata: AttentionMetadata | None = None


def get_attn_metadata() -> AttentionMetadata:
    if _attn_metadata is None:
        raise RuntimeError("attention ran outside a forward context")
    return _attn_metadata


@contextmanager
def forward_context(metadata: AttentionMetadata):
    global _attn_metadata
    _attn_metadata = metadata
    try:
        yield
    finally:
        _attn_metadata = None
