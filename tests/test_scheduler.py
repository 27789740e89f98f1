"""Unit tests of the scheduler with hand-made requests and no model: budget, order, chunking, preemption."""
from kvflow.config import EngineConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler
from kvflow.request import Request, RequestStatus
from kvflow.runner.step import SampledTokens
from kvflow.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, **cfg):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    return Scheduler(EngineConfig(**cfg), kv, max_model_len=256), kv


def add(sched, rid, n, max_tokens=4, requests=None):
    r = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens)
    sched.add_request(r)
    if requests is not None:
        requests[rid] = r
    return r


def sampled(out, token=7):
    rows = len(out.step.sampling) if out.step else 0
    return SampledTokens([token] * rows, [None] * rows)


def run_step(sched, requests, token=7):
    out = sched.schedule()
    sched.update(out, sampled(out, token))
    return out


def test_decodes_first_then_waiting_in_arrival_order_under_the_budget():
    sched, kv = make(max_num_batched_tokens=10)
    reqs = {}
    add(sched, "a", 6, requests=reqs)
    run_step(sched, reqs)                   # a prefilled
    add(sched, "b", 8, requests=reqs)
    add(sched, "c", 3, requests=reqs)
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 8), ("c", 1)]
    assert not out.scheduled[2].samples     # c is a chunk: 1 of its 3 prompt tokens


def test_long_prompt_is_prefilled_in_chunks():
    sched, kv = make(max_num_batched_tokens=8)
    reqs = {}
    r = add(sched, "a", 20, requests=reqs)
    chunks = [run_step(sched, reqs).scheduled[0].num_new_tokens for _ in range(3)]
    assert chunks == [8, 8, 4]
    assert r.num_output_tokens == 1 and r.num_computed_tokens == 20


def test_max_num_seqs_caps_the_running_batch():
    sched, kv = make(max_num_seqs=2)
    reqs = {}
    for i in range(4):
        add(sched, str(i), 3, requests=reqs)
    out = run_step(sched, reqs)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_preemption_recomputes_the_newest_request_and_loses_nothing():
    sched, kv = make(num_blocks=4, block_size=4)
    reqs = {}
    a = add(sched, "a", 7, max_tokens=8, requests=reqs)
    b = add(sched, "b", 7, max_tokens=8, requests=reqs)
    finished = []
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        finished += [o for o in sched.update(out, sampled(out)) if o.finished]
    assert sched.num_preemptions > 0
    assert {o.request_id for o in finished} == {"a", "b"}
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    kv.check()


def test_static_policy_admits_the_next_batch_only_when_the_running_one_is_done():
    sched, kv = make(scheduling_policy="static", max_num_seqs=2)
    reqs = {}
    add(sched, "a", 3, max_tokens=2, requests=reqs)
    add(sched, "b", 3, max_tokens=5, requests=reqs)
    add(sched, "c", 3, max_tokens=2, requests=reqs)
    seen_c_before_b_done = False
    while sched.has_unfinished_requests():
        out = run_step(sched, reqs)
        ids = {s.request_id for s in out.scheduled}
        if "c" in ids and reqs["b"].status == RequestStatus.RUNNING:
            seen_c_before_b_done = True
    assert not seen_c_before_b_done
    kv.check()


def test_abort_frees_blocks_wherever_the_request_is():
    sched, kv = make(max_num_seqs=1)
    reqs = {}
    a = add(sched, "a", 5, requests=reqs)
    b = add(sched, "b", 5, requests=reqs)
    run_step(sched, reqs)
    sched.abort(["a", "b"])
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests()
    kv.check()


def test_prefill_is_capped_only_while_others_are_decoding():
    sched, kv = make(max_num_batched_tokens=16, max_prefill_tokens_while_decoding=3)
    reqs = {}
    add(sched, "a", 10, max_tokens=20, requests=reqs)
    assert [s.num_new_tokens for s in run_step(sched, reqs).scheduled] == [10]   # no one decoding: full budget
    add(sched, "long", 12, max_tokens=2, requests=reqs)
    chunks = []
    for _ in range(4):
        out = run_step(sched, reqs)
        assert ("a", 1) == (out.scheduled[0].request_id, out.scheduled[0].num_new_tokens)   # a keeps decoding
        chunks += [s.num_new_tokens for s in out.scheduled if s.request_id == "long"]
    assert chunks == [3, 3, 3, 3]                     # while a streams, the prompt advances 3 tokens a step
    assert reqs["long"].num_output_tokens == 1
    # once nothing decodes, a new prompt takes the whole budget again
    while sched.running:
        run_step(sched, reqs)
    add(sched, "c", 14, requests=reqs)
    assert [s.num_new_tokens for s in run_step(sched, reqs).scheduled] == [14]


def test_prefill_cap_must_not_be_negative():
    import pytest
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        EngineConfig(max_prefill_tokens_while_decoding=-1)


def test_a_mixed_step_hands_the_runner_everything_it_needs():
    """The step's contents for one decode and one prompt chunk: rows (decodes first), token ids, where each chunk
    starts, block tables, which rows sample, and the sampling rows (min_tokens blocks EOS, a seed per position)."""
    sched, kv = make(max_num_batched_tokens=10, block_size=4)
    a = Request("a", [11, 12, 13, 14, 15, 16], SamplingParams(max_tokens=9, min_tokens=3, seed=5), 9)
    a.eos_token_ids = frozenset({2})
    sched.add_request(a)
    first = sched.schedule()
    assert first.step.batch.num_decodes == 0 and first.step.batch.token_ids == [11, 12, 13, 14, 15, 16]
    sched.update(first, SampledTokens([7], [None]))          # a: 6 prompt tokens computed, sampled 7
    b = add(sched, "b", 12)                                  # 12 prompt tokens: 9 fit this step's budget
    out = sched.schedule()
    batch = out.step.batch
    assert [s.request_id for s in out.rows] == ["a", "b"]
    assert batch.num_decodes == 1
    assert batch.token_ids == [7] + list(range(1, 10))       # a's last token, then b's first 9
    assert (batch.num_computed_tokens, batch.num_new_tokens) == ([6, 0], [1, 9])
    assert batch.block_tables == [kv.block_tables["a"], kv.block_tables["b"]]
    assert [len(t) for t in batch.block_tables] == [2, 3]    # 7 and 9 tokens in blocks of 4
    assert len(set(batch.block_tables[0]) | set(batch.block_tables[1])) == 5
    assert batch.samples == [True, False]                    # b's chunk ends inside its prompt: nothing to sample
    [row] = out.step.sampling
    assert (row.params, row.token_ids, row.num_prompt_tokens) == (a.params, a.token_ids, 6)
    assert set(row.blocked_token_ids) == {2}                 # 1 of min_tokens=3: EOS may not end it yet
    assert row.seed is not None and row.seed != first.step.sampling[0].seed    # a fresh seed per position
    outputs = sched.update(out, SampledTokens([8], [None]))
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [8])]
    assert (a.num_computed_tokens, b.num_computed_tokens) == (7, 9)


# ---- priorities (vLLM's: a lower value first; the Batch API's lines run at 10) --------------------------------
def add_p(sched, rid, n, priority, max_tokens=4):
    r = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens,
                priority=priority)
    sched.add_request(r)
    return r


def test_a_waiting_interactive_request_is_admitted_before_earlier_batch_requests():
    sched, kv = make(max_num_seqs=2)
    for i in range(3):
        add_p(sched, f"batch{i}", 3, priority=10)
    add_p(sched, "chat", 3, priority=0)                  # arrives last
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["chat", "batch0"]
    assert [r.request_id for r in sched.waiting] == ["batch1", "batch2"]


def test_an_interactive_request_preempts_a_batch_request_when_max_num_seqs_is_full():
    sched, kv = make(max_num_seqs=2)
    reqs = {}
    for i in range(2):
        reqs[f"batch{i}"] = add_p(sched, f"batch{i}", 3, priority=10, max_tokens=50)
    run_step(sched, reqs)
    add_p(sched, "chat", 3, priority=0)
    out = sched.schedule()
    assert out.preempted_ids == ["batch1"]               # the newest of the highest value
    assert [s.request_id for s in out.scheduled] == ["chat"]   # batch0 sits out the step that admits chat
    assert reqs["batch1"].status == RequestStatus.PREEMPTED and sched.waiting.peek() is reqs["batch1"]
    sched.update(out, sampled(out))
    while sched.has_unfinished_requests():
        run_step(sched, reqs)
    assert reqs["batch1"].num_output_tokens == 50        # recomputed, nothing lost
    kv.check()


def test_when_blocks_run_out_a_batch_request_is_preempted_never_an_interactive_one():
    # 6 blocks of 4 tokens: two long-running requests cannot both grow to 16 tokens
    sched, kv = make(num_blocks=6, block_size=4)
    chat = add_p(sched, "chat", 7, priority=0, max_tokens=9)
    batch = add_p(sched, "batch", 7, priority=10, max_tokens=9)
    preempted = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        preempted += out.preempted_ids
        sched.update(out, sampled(out))
    assert preempted and set(preempted) == {"batch"}
    assert chat.num_preemptions == 0 and chat.num_output_tokens == 9 and batch.num_output_tokens == 9
    kv.check()


def test_batch_rows_sit_out_the_step_that_admits_an_interactive_request():
    sched, kv = make(max_num_batched_tokens=8)
    reqs = {"batch": add_p(sched, "batch", 20, priority=10)}
    run_step(sched, reqs)                                # batch: 8 of 20 prompt tokens
    add_p(sched, "chat", 6, priority=0)
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("chat", 6)]
    sched.update(out, sampled(out))
    assert [(s.request_id, s.num_new_tokens) for s in sched.schedule().scheduled] == [("chat", 1), ("batch", 7)]


def test_batch_decodes_sit_out_the_step_that_admits_an_interactive_request_then_resume():
    sched, kv = make()
    reqs = {"batch": add_p(sched, "batch", 4, priority=10, max_tokens=20)}
    run_step(sched, reqs)
    run_step(sched, reqs)                                # batch decoding
    add_p(sched, "chat", 6, priority=0)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["chat"]
    sched.update(out, sampled(out))
    assert [s.request_id for s in sched.schedule().scheduled] == ["chat", "batch"]   # both decode


def test_equal_priorities_are_first_come_first_served_and_abort_finds_waiting_requests():
    sched, kv = make(max_num_seqs=1)
    for rid, p in (("a", 5), ("b", 5), ("c", 1)):
        add_p(sched, rid, 3, priority=p)
    assert [r.request_id for r in sched.waiting] == ["c", "a", "b"]
    sched.abort(["a"])
    assert [r.request_id for r in sched.waiting] == ["c", "b"] and len(sched.waiting) == 2
    kv.check()


def test_batch_rows_are_capped_while_interactive_requests_run_and_full_width_after(monkeypatch):
    import kvflow.core.scheduler as scheduler_module

    sched, kv = make(max_background_seqs=2)
    reqs = {f"batch{i}": add_p(sched, f"batch{i}", 3, priority=10, max_tokens=40) for i in range(6)}
    out = run_step(sched, reqs)
    assert len(out.scheduled) == 6                       # no interactive traffic: full width
    reqs["chat"] = add_p(sched, "chat", 3, priority=0, max_tokens=3)
    run_step(sched, reqs)                                # chat admitted (batch sits out)
    out = run_step(sched, reqs)
    assert [s.request_id for s in out.scheduled] == ["chat", "batch0", "batch1"]   # 2 background rows
    run_step(sched, reqs)                                # chat's last token
    assert "chat" not in sched.requests
    out = run_step(sched, reqs)
    assert len(out.scheduled) == 2                       # within the grace period after it: still capped
    monkeypatch.setattr(scheduler_module, "FOREGROUND_GRACE_S", 0.0)
    import time
    time.sleep(0.01)
    out = run_step(sched, reqs)
    assert len(out.scheduled) == 6                       # full width again


def test_background_work_takes_at_most_max_background_tokens_of_a_step_at_all_times():
    # no interactive request anywhere: batch lines still get only 16 tokens a step, so a step of them is short
    sched, kv = make(max_background_tokens=16, max_num_batched_tokens=64)
    reqs = {f"batch{i}": add_p(sched, f"batch{i}", 10, priority=10, max_tokens=8) for i in range(3)}
    out = run_step(sched, reqs)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("batch0", 10), ("batch1", 6)]
    out = run_step(sched, reqs)                          # batch0 decodes (1), batch1 ends its prompt (4), batch2
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("batch0", 1), ("batch1", 4),
                                                                         ("batch2", 10)]
    reqs["chat"] = add_p(sched, "chat", 40, priority=0)  # priority 0 is not capped: its whole prompt at once
    out = run_step(sched, reqs)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("chat", 40)]
    while sched.has_unfinished_requests():
        out = run_step(sched, reqs)
        assert sum(s.num_new_tokens for s in out.scheduled if s.request_id != "chat") <= 16
    assert all(r.num_output_tokens == r.max_tokens for r in reqs.values())
    kv.check()
    # 0: no cap, the whole budget
    sched, kv = make(max_background_tokens=0, max_num_batched_tokens=64)
    reqs = {f"batch{i}": add_p(sched, f"batch{i}", 10, priority=10) for i in range(3)}
    assert sum(s.num_new_tokens for s in run_step(sched, reqs).scheduled) == 30


# ---- LoRA slots (core/lora_slots.py): residency decides admission, swaps at the step boundary ----------------------
def make_lora(max_loras=2, max_cpu_loras=None, **cfg):
    from kvflow.core.lora_slots import LoRASlots

    loads = []

    def loader(lora):
        if lora.lora_path == "/gone":
            raise ValueError("no such folder")
        loads.append(lora.lora_name)
        return f"weights of {lora.lora_name}"

    slots = LoRASlots(max_loras, max_cpu_loras or max_loras, loader)
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    config = EngineConfig(enable_lora=True, max_loras=max_loras, **cfg)
    return Scheduler(config, kv, max_model_len=256, lora_slots=slots), kv, slots, loads


def add_l(sched, rid, n, lora, max_tokens=2, tokens=None):
    r = Request(rid, tokens or list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                max_tokens, lora=lora)
    sched.add_request(r)
    return r


def lora(name, i, path=None):
    from kvflow.lora_request import LoRARequest
    return LoRARequest(name, i, path or f"/adapters/{name}")


def test_a_request_whose_adapter_has_no_slot_waits_and_later_ones_go_ahead():
    sched, kv, slots, loads = make_lora(max_loras=2)
    a, b, c = lora("a", 1), lora("b", 2), lora("c", 3)
    add_l(sched, "ra", 3, a)
    add_l(sched, "rb", 3, b)
    add_l(sched, "rc", 3, c)           # no third slot while a and b run: waits
    add_l(sched, "base", 3, None)      # the base model needs no slot: goes ahead of rc
    add_l(sched, "ra2", 3, a)          # a is resident: goes ahead of rc
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["ra", "rb", "base", "ra2"]
    assert out.step.batch.lora_slots == (0, 1, -1, 0)
    assert sorted(slots.take_swaps()) == [(0, "weights of a"), (1, "weights of b")]
    sched.update(out, sampled(out))
    assert [r.request_id for r in sched.waiting] == ["rc"]
    out = sched.schedule()             # everyone decodes; rc still waits (a and b run)
    assert "rc" not in [s.request_id for s in out.scheduled] and slots.take_swaps() == []
    sched.update(out, sampled(out))    # max_tokens=2: all done
    out = sched.schedule()             # c takes the least recently used slot (b's: a was used later)
    assert [s.request_id for s in out.scheduled] == ["rc"] and out.step.batch.lora_slots == (1,)
    assert slots.take_swaps() == [(1, "weights of c")] and slots.slots == [1, 3]
    sched.update(out, sampled(out))
    sched.update(sched.schedule(), SampledTokens([7], [None]))
    assert not sched.has_unfinished_requests()
    kv.check()
    slots.check()
    assert loads == ["a", "b", "c"]


def test_without_lora_rows_the_step_carries_no_slots_and_a_preempted_request_gets_its_slot_back():
    sched, kv, slots, _ = make_lora(max_loras=1)
    out = sched.schedule()
    assert out.step is None
    add_l(sched, "base", 3, None)
    out = sched.schedule()
    assert out.step.batch.lora_slots == ()
    sched.update(out, sampled(out))
    r = add_l(sched, "ra", 3, lora("a", 1), max_tokens=4)
    out = sched.schedule()
    sched.update(out, sampled(out))
    sched._preempt(r)                   # as the scheduler does when blocks run out
    sched.running.remove(r)
    slots.take_swaps()
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["ra"]
    assert slots.take_swaps() == []     # still resident: no swap
    assert out.step.batch.lora_slots[-1] == 0


def test_an_adapter_that_cannot_be_read_fails_its_request_alone():
    sched, kv, slots, _ = make_lora(max_loras=1)
    add_l(sched, "bad", 3, lora("x", 5, "/gone"))
    add_l(sched, "good", 3, None)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["good"]
    [failed] = sched.failed
    assert failed.request_id == "bad" and failed.finish_reason == "error" and "no such folder" in failed.stop_reason


def test_prefix_cache_blocks_are_keyed_by_the_adapter():
    sched, kv, slots, _ = make_lora(max_loras=2)
    prompt = list(range(1, 10))        # two full blocks of 4
    a, b = lora("a", 1), lora("b", 2)
    for rid, adapter in (("r1", a), ("r2", b), ("r3", None), ("r4", a)):
        r = add_l(sched, rid, 9, adapter, max_tokens=1, tokens=prompt)
        out = sched.schedule()
        sched.update(out, sampled(out))
        assert r.num_cached_tokens == (8 if rid == "r4" else 0), rid
    kv.check()


# ---- the scheduler's seams: the waiting queue by policy, the step budget, prefix-cache counters on admission ------
def test_every_scheduling_policy_has_a_waiting_queue():
    from kvflow.config import SCHEDULING_POLICIES
    from kvflow.core.waiting_queue import REQUEST_QUEUES, StaticBatchQueue, WaitingQueue, create_request_queue

    assert set(REQUEST_QUEUES) == set(SCHEDULING_POLICIES)
    assert type(create_request_queue("static")) is StaticBatchQueue
    assert all(type(create_request_queue(p)) is WaitingQueue for p in ("continuous", "fcfs", "priority"))


def test_the_step_budget_counts_rows_and_tokens_by_value():
    from kvflow.core.step_budget import StepBudget

    chat = Request("chat", [1, 2], SamplingParams(max_tokens=1), 1)
    batch = Request("batch", [1, 2], SamplingParams(max_tokens=1), 1, priority=10)
    budget = StepBudget(tokens=64, prefill_tokens=8, background_above=0, background_rows=1, background_tokens=16,
                        draft_rows=4)
    assert budget.take_row(chat) == 64                    # priority 0: the whole budget, no background row
    budget.take(chat, 6, prefill=True)
    assert (budget.tokens, budget.prefill_tokens, budget.background_tokens) == (58, 2, 16)
    assert budget.take_row(batch) == 16                   # the one background row, its tokens capped
    budget.take(batch, 3, num_drafts=2)
    assert (budget.tokens, budget.background_tokens, budget.draft_rows) == (55, 13, 2)
    assert budget.take_row(batch) == 0                    # no background row left


def test_prefix_cache_queries_count_once_when_the_request_is_admitted():
    kv = KVCacheManager(4, 4, enable_prefix_caching=True)
    sched = Scheduler(EngineConfig(), kv, max_model_len=256)
    reqs = {"a": add(sched, "a", 12, max_tokens=2)}
    run_step(sched, reqs)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (12, 0)
    b = Request("b", list(range(1, 5)) + [50] * 8, SamplingParams(max_tokens=1, ignore_eos=True), 1)
    sched.add_request(b)                                  # a's first block, then 2 blocks more than are free
    out = run_step(sched, reqs)
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (12, 0)     # b looked, waits: not counted
    out = run_step(sched, reqs)                           # a finished last step: b is admitted, its hit counted
    assert [s.request_id for s in out.scheduled] == ["b"] and b.num_cached_tokens == 4
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (24, 4)
    kv.check()
