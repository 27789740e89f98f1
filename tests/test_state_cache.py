"""The scheduler's side of a hybrid model's state (core/state_cache.py), with hand-made requests and no model: live
slots taken at admission and given back at finish, abort and preemption; a slot zeroed before a fresh request's first
step; prefix-cache hits cut back to the last checkpoint and restored by a copy; checkpoints written at a prompt's last
block boundary and at a shared prefix's junction, evicted least recently used first; speculative snapshots; and the
split of the budget (runner/state_memory.py)."""
import pytest

from kvflow.config import EngineConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler
from kvflow.core.state_cache import StateCache
from kvflow.request import Request
from kvflow.runner.state_memory import StateSlotCounts, plan_state_slots
from kvflow.runner.step import SampledTokens
from kvflow.sampling_params import SamplingParams

BS = 4


def make(live=4, snapshots=0, checkpoints=4, num_blocks=64, prefix=True, **cfg):
    state = StateCache(StateSlotCounts(live, snapshots, checkpoints, slot_bytes=100), kv_bytes=num_blocks * 10)
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix, state=state)
    return Scheduler(EngineConfig(**cfg), kv, max_model_len=256), kv, state


def add(sched, rid, tokens, max_tokens=2):
    r = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens)
    sched.add_request(r)
    return r


def step(sched, token=7):
    out = sched.schedule()
    rows = len(out.step.sampling) if out.step else 0
    sched.update(out, SampledTokens([token] * rows, [None] * rows))
    return out


def finish(sched):
    while sched.has_unfinished_requests():
        step(sched)


def test_live_slots_follow_requests_and_fresh_ones_are_zeroed():
    sched, kv, state = make(live=2, max_num_seqs=8)
    for rid in "abc":
        add(sched, rid, range(1, 7))
    out = sched.schedule()
    # two slots: the third request waits for one
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    batch = out.step.batch
    assert batch.state_slots == (state.slot("a"), state.slot("b"))
    assert sorted(batch.state_copies) == sorted([(-1, state.slot("a")), (-1, state.slot("b"))])
    rows = len(out.step.sampling)
    sched.update(out, SampledTokens([7] * rows, [None] * rows))
    finish(sched)
    kv.check()


def test_abort_and_preemption_give_the_slot_back():
    sched, kv, state = make(live=2, num_blocks=6, max_num_seqs=8, max_num_batched_tokens=64)
    add(sched, "a", range(1, 9), max_tokens=8)
    add(sched, "b", range(11, 19), max_tokens=8)
    step(sched)
    assert set(state.live) == {"a", "b"}
    sched.abort(["a"])
    assert set(state.live) == {"b"}
    # "c" needs blocks "b" holds only when it grows: preemption frees b's slot with its blocks
    add(sched, "c", range(21, 29), max_tokens=8)
    while sched.has_unfinished_requests():
        step(sched)
        assert len(state.live) <= 2
    assert sched.num_preemptions > 0
    kv.check()


def test_a_repeated_prompt_restores_the_checkpoint_of_its_last_block_boundary():
    sched, kv, state = make()
    prompt = list(range(1, 15))                 # 14 tokens: boundaries at 4, 8, 12; the last one 12
    add(sched, "a", prompt)
    out = sched.schedule()
    (entry, offset, ckpt), = out.step.batch.state_snapshots
    assert (entry, offset) == (0, 11)           # the state after position 11 (12 tokens: 3 whole blocks)
    rows = len(out.step.sampling)
    sched.update(out, SampledTokens([7] * rows, [None] * rows))
    assert list(state.checkpoints.values()) == [ckpt]
    finish(sched)
    b = add(sched, "b", prompt)
    out = sched.schedule()
    assert b.num_cached_tokens == 12 and out.scheduled[0].num_new_tokens == 2
    assert (ckpt, state.slot("b")) in out.step.batch.state_copies
    assert kv.prefix_cache_hits == 12
    finish(sched)
    kv.check()


def test_hits_stop_at_the_last_checkpoint_and_a_junction_gets_one():
    sched, kv, state = make()
    system = list(range(100, 110))              # 10 shared tokens: 2 whole blocks
    add(sched, "a", system + [1, 2, 3, 4, 5, 6])
    finish(sched)
    # b shares a's first 2 blocks, whose KV is cached, but a's checkpoint is at its own 16th token: no hit
    b = add(sched, "b", system + [9, 9, 9, 9, 9, 9, 9])
    out = sched.schedule()
    assert b.num_cached_tokens == 0
    offsets = sorted(o for _, o, _ in out.step.batch.state_snapshots)
    assert offsets == [7, 15]                   # the junction (8 tokens) and b's own last boundary (16)
    rows = len(out.step.sampling)
    sched.update(out, SampledTokens([7] * rows, [None] * rows))
    finish(sched)
    c = add(sched, "c", system + [5, 5, 5, 5, 5])
    sched.schedule()
    assert c.num_cached_tokens == 8             # from the junction's checkpoint
    finish(sched)
    kv.check()


def test_checkpoints_are_evicted_least_recently_used_first():
    sched, kv, state = make(checkpoints=2)
    prompts = [list(range(10 * i, 10 * i + 9)) for i in range(1, 4)]      # 9 tokens each: a checkpoint at 8
    for i, p in enumerate(prompts):
        add(sched, str(i), p)
        finish(sched)
    assert len(state.checkpoints) == 2 and state.num_checkpoint_evictions == 1
    r = add(sched, "again0", prompts[0])        # its checkpoint was the oldest: evicted
    sched.schedule()
    assert r.num_cached_tokens == 0
    finish(sched)
    kv.check()


def test_speculating_rows_snapshot_and_a_rejection_restores_the_accepted_state():
    from kvflow.speculative_config import SpeculativeConfig
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2)
    sched, kv, state = make(snapshots=4, speculative_config=spec)
    add(sched, "a", [5, 6, 5, 6, 5, 6, 5], max_tokens=6)
    step(sched, token=6)                        # prefill: next token 6; n-gram drafts follow 5 6 5 ...
    out = sched.schedule()
    s, = out.scheduled
    assert len(s.draft_token_ids) == 2
    batch = out.step.batch
    slot = state.slot("a")
    assert batch.state_slots == (slot, slot, slot)
    snaps = [x[2] for x in batch.state_snapshots]
    assert [x[:2] for x in batch.state_snapshots] == [(0, 0), (1, 0)]
    # the first draft rejected: the state after the last token (snapshot 0) goes back into the live slot
    rows = len(out.step.sampling)
    sched.update(out, SampledTokens([99] * rows, [None] * rows))
    assert state.copies == [(snaps[0], slot)]
    finish(sched)
    kv.check()


def test_budget_split():
    counts = plan_state_slots(budget=10_000, slot_bytes=10, block_bytes=1, blocks_for_one_request=100,
                              max_num_seqs=8, num_speculative_tokens=2, prefix_caching=True)
    # checkpoints set aside first (1/16 of the budget), a live slot per max_num_seqs, snapshots for each
    assert (counts.checkpoints, counts.live, counts.snapshots) == (62, 8, 16)
    # live slots up to half the budget (and what it holds beside one request's blocks); the scheduler admits fewer
    assert plan_state_slots(1000, 100, 1, 100, 64, 0, False).live == 5
    assert plan_state_slots(1000, 100, 1, 800, 64, 0, False).live == 2
    with pytest.raises(ValueError, match="recurrent state"):
        plan_state_slots(1000, 600, 1, 500, 64, 0, False)


def test_a_step_wanting_more_checkpoints_than_slots_keeps_what_fits():
    sched, kv, state = make(checkpoints=1, max_num_batched_tokens=64)
    for rid in "ab":
        add(sched, rid, range(10 * ord(rid), 10 * ord(rid) + 9))     # each wants a checkpoint at 8
    out = sched.schedule()
    assert len(out.step.batch.state_snapshots) == 1
    rows = len(out.step.sampling)
    sched.update(out, SampledTokens([7] * rows, [None] * rows))
    finish(sched)
    assert len(state.checkpoints) == 1
    kv.check()
