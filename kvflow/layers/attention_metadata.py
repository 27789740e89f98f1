"""The per-step attention metadata. Everything here is built once per step by the model runner
(`prepare_inputs`) so that the 30-odd attention layers do no per-sequence Python: decodes are one padded batch,
prefill chunks another.

The runner passes the metadata to the model explicitly: a compiled graph must read no module state, and the
background compile thread runs its own steps. So there is no forward context (DESIGN's one piece of
module-level mutable state) any more.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.kernels.recurrent import StateBatch


@dataclass
class PrefillBatch:
    """Every prefill chunk of the step, padded to the longest chunk (queries) and the longest context (keys) and
    attended in one masked call. Keys are read back from the cache, so a chunk with a past (a later chunk, a
    prefix-cache hit) is no special case. Padding sits at the end of each sequence's keys, so a sequence's
    attention sums are the same whatever else shares the step."""
    num_seqs: int
    max_q_len: int
    max_context_len: int
    query_rows: torch.Tensor      # [P * max_q_len] row of the flat prefill rows behind each padded query (pads: 0)
    output_rows: torch.Tensor     # [prefill rows] where each real row sits in the padded [P * max_q_len] layout
    key_slots: torch.Tensor       # [P * max_context_len] cache slot of each padded key (pads: the scratch slot)
    mask: torch.Tensor | None     # [P, 1, max_q_len, max_context_len] additive 0 / -inf; None: one chunk, no past
    # the same for sliding-window layers (also keys more than `sliding_window` positions back masked); None where no
    # query of the step has keys beyond its window (then `mask` serves them). With `mask` None: [1, 1, L, L] over
    # the chunk's own keys
    mask_sliding: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [num_tokens] flat cache slot of each new token
    num_decode_tokens: int                # the first rows of the batch are decodes, one token each
    decode_block_tables: torch.Tensor | None = None   # [num_decodes, max_blocks] (pads: the scratch block)
    decode_mask: torch.Tensor | None = None           # [num_decodes, 1, 1, max_blocks*block_size] additive 0 / -inf
    decode_mask_sliding: torch.Tensor | None = None   # decode_mask for sliding-window layers (None: decode_mask)
    prefill: PrefillBatch | None = None
    # kvflow's attention kernel (kernels/csrc/attention.c), when it runs: every row alone, over its own keys
    seq_tables: torch.Tensor | None = None            # [sequences, max_blocks] block tables (pads: the scratch block)
    row_seq: torch.Tensor | None = None               # [num_tokens] each row's sequence (a row of seq_tables)
    positions: torch.Tensor | None = None             # [num_tokens] each row's position: it sees keys 0..position
    # LoRA (enable_lora only): [num_tokens, max_loras * max_lora_rank], 1.0 in the columns of each token's adapter
    # slot, zeros for base rows and padding (layers/lora.py); None: no row of this (eager) step has an adapter
    lora_mask: torch.Tensor | None = None
    # a model with recurrent layers (hybrids): which state slot each run of rows continues (None: no such layers)
    state: StateBatch | None = None
