"""How a hybrid model's KV cache budget is split between KV blocks and state slots (the one place that decides).

A recurrent layer's state is fixed-size per request and large next to one token's KV (Qwen3.5-0.8B: 19.3 MiB of
float32 state, the KV of ~1,600 of its tokens; LFM2-1.2B: 160 KiB), so it is budgeted in slots, not blocks, as
llama.cpp and SGLang keep it. The slots of every recurrent layer's state tensors are numbered alike:

- `live`: one per running request, up to max_num_seqs, as llama.cpp keeps a cell per slot, but at most half the budget
  (Qwen3.5-0.8B's 128 slots would be 2.4 GiB, the whole default budget, leaving the KV blocks one request's worth):
  with fewer, the scheduler admits a request only while a slot is free;
- `checkpoints`: prefix caching's states at block boundaries, keyed by the block's hash chain, at most
  1/CHECKPOINT_SHARE of the budget, set aside first (a hybrid's prefix-cache hit needs one);
- `snapshots`: speculative decoding's per-draft states (num_speculative_tokens per speculating request): a rejected
  draft has already been absorbed into the live state, so the state after the last accepted token is copied back
  from its snapshot; at most 1/SNAPSHOT_SHARE of the budget.

The KV blocks get the rest, never less than one request of max_model_len needs.
"""
from __future__ import annotations

from dataclasses import dataclass

LIVE_SHARE = 2           # live slots take at most 1/LIVE_SHARE of the budget: the KV blocks keep room for long prompts
CHECKPOINT_SHARE = 16    # prefix-cache checkpoints take at most 1/CHECKPOINT_SHARE of the budget
SNAPSHOT_SHARE = 8       # speculative snapshots at most 1/SNAPSHOT_SHARE of it


@dataclass(frozen=True)
class StateSlotCounts:
    live: int
    snapshots: int
    checkpoints: int
    slot_bytes: int          # one slot of every recurrent layer's state tensors

    @property
    def total(self) -> int:
        return self.live + self.snapshots + self.checkpoints

    @property
    def first_snapshot(self) -> int:
        return self.live

    @property
    def first_checkpoint(self) -> int:
        return self.live + self.snapshots


def plan_state_slots(budget: int, slot_bytes: int, block_bytes: int, blocks_for_one_request: int, max_num_seqs: int,
                     num_speculative_tokens: int, prefix_caching: bool) -> StateSlotCounts:
    """The slots of each kind a budget of `budget` bytes gives, live ones first (ValueError: not even one)."""
    room = budget - blocks_for_one_request * block_bytes
    checkpoints = 0
    if prefix_caching:
        checkpoints = max(0, min(room // 2, budget // CHECKPOINT_SHARE)) // slot_bytes
        room -= checkpoints * slot_bytes
    live = min(max_num_seqs, max(room, 0) // slot_bytes, budget // LIVE_SHARE // slot_bytes)
    if live < 1:
        raise ValueError(
            f"the KV cache budget ({budget / 2**20:.1f} MiB) cannot hold one request's recurrent state "
            f"({slot_bytes / 2**20:.2f} MiB) beside the KV blocks of one request of max_model_len "
            f"({blocks_for_one_request} blocks of {block_bytes / 2**20:.3f} MiB); raise kv_cache_memory or lower "
            "max_model_len")
    room -= live * slot_bytes
    snapshots = 0
    if num_speculative_tokens:
        speculating = min(live, min(room, budget // SNAPSHOT_SHARE) // (slot_bytes * num_speculative_tokens))
        snapshots = speculating * num_speculative_tokens
    return StateSlotCounts(live, snapshots, checkpoints, slot_bytes)
