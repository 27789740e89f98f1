"""Scheduler: decides who runs each step and how many tokens each computes. It never touches tensors.

One token budget per step (`StepBudget` holds what is left of it, and of the caps below, while the step is handed
out). Running requests go first (a decode costs one token, an unfinished prefill takes what is left of the budget);
then waiting requests are admitted while the budget, `max_num_seqs` and free blocks allow. A request that needs a
block when none is free preempts the newest running request, which loses its KV and goes back to the head of the
waiting queue (recompute). The waiting queue is the `--scheduling-policy`'s (`create_request_queue`): the order its
requests leave in, and when they may (static batching: a whole batch, then nothing until it has finished). A
request's prefix-cache query (vLLM's `prefix_cache_queries` / `hits`) counts when it is admitted.

Priorities (vLLM's: a lower `Request.priority` value first; interactive requests 0, the Batch API's lines 10):
the waiting queue is admitted lowest value first (`WaitingQueue`), the running list is kept in (priority,
admission) order so a step's budget goes to lower values first and the preemption victim — always the last
running request — is the newest of the highest value; and a waiting request of a lower value than some running
request preempts those running requests when `max_num_seqs` or the free blocks would keep it waiting, and they
sit out the step it is admitted in (decodes too): its time to first token is then what it would be without them,
but for the step already under way when it arrived. That step is kept short: while requests of the lowest value
run (or ran within the last FOREGROUND_GRACE_S), requests of higher values take at most `max_background_seqs` rows
of a step (on a CPU a decode step's time grows with its rows: a few more cost little, 64 more double it). Batch
work fills what interactive traffic leaves idle. And at all times, interactive traffic or not, requests of values
above 0 take at most `max_background_tokens` tokens of a step: a step of batch work alone is short, so the first
interactive request to arrive, which cannot interrupt it, waits little. With every request at 0 this is plain
first-come, first-served.

`max_prefill_tokens_while_decoding` (0: off) caps the prompt tokens of a step while any running request is
already generating: a step with a long prefill chunk is a long gap between the streaming requests' tokens,
so while they stream, prompts advance in small chunks; with no one decoding, prompts take the whole budget.

`schedule()` hands out the whole step (`SchedulerOutput.step`: rows, token ids, block tables, sampling rows);
`update()` takes the sampled tokens back and returns what each request produced (`EngineOutput`s).

An embedding or score request (`Request.pooling`) is a prompt that never samples: its chunks run in the same steps
as everyone's, each chunk's pooled positions (the engine's pooling: the last prompt position, every one, or the
first) go out summed in `EngineOutput.pooled_sum`, and it finishes after its last chunk, its blocks freed. With mean
or cls pooling it takes no prefix-cache hits (a hit skips positions whose hidden states it needs); with last pooling
it does (the last position is always computed, on top of the same cached KV a recompute would write). An encoder's
prompts (`whole_prompts`) are never split: each runs whole in one step, or waits for the next.

LoRA (`Request.lora`, `enable_lora`): a request is admitted only if its adapter is in one of the model's
`max_loras` slots or can be put in one this step (a free slot, or the least recently used one whose adapter no
running request uses: `LoRASlots`); otherwise it waits and the requests behind it (the base model's, resident
adapters') may go first. The slot swaps are applied by the engine core before the step's forward; every row
carries its slot (`StepBatch.lora_slots`).
"""
from __future__ import annotations

import bisect
import time

from kvflow.config import EngineConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.lora_slots import LoRASlots
from kvflow.core.outputs import EngineOutput, ScheduledRequest, SchedulerOutput
from kvflow.core.step_budget import StepBudget
from kvflow.core.waiting_queue import create_request_queue
from kvflow.request import Request, RequestStatus
from kvflow.runner.step import ModelStep, PromptLogprobsRow, SampledTokens, SamplingRow, StepBatch
from kvflow.spec_decode import make_proposer


# how deep into the waiting queue the scheduler looks for a request it can admit when the head's LoRA adapter cannot
# get a slot this step (bounds the scan; the rest wait for the next step)
LORA_LOOKAHEAD = 256

# how long the lowest priority value seen keeps the higher ones capped after its last request (a client's next
# turn usually comes within it; a full-width batch step is then not under way when it arrives)
FOREGROUND_GRACE_S = 1.0
NO_PRIORITY = float("inf")


def _priority(req: Request) -> int:
    return req.priority


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager, max_model_len: int,
                 lora_slots: LoRASlots | None = None, pooling: str | None = None, whole_prompts: bool = False):
        """`pooling`: the positions an embedding request pools (the engine's, resolved with the model's; default
        `config.pooling` or last); `whole_prompts`: an encoder's, each prompt computed in one step."""
        self.max_num_seqs = config.max_num_seqs
        # an encoder's prompt is never split: a step holds at least one of max_model_len
        self.whole_prompts = whole_prompts
        self.max_num_batched_tokens = (max(config.max_num_batched_tokens, max_model_len) if whole_prompts
                                       else config.max_num_batched_tokens)
        self.max_prefill_tokens_while_decoding = config.max_prefill_tokens_while_decoding
        self.pooling = pooling or config.pooling or "last"
        self.pool_every_position = self.pooling == "mean"     # else one position: the last, or the first (cls)
        self.max_model_len = max_model_len
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}   # every unfinished request, by id
        self.waiting = create_request_queue(config.scheduling_policy)   # lowest priority value first, then arrival
        self.running: list[Request] = []      # (priority, admission) order: the last is preempted first
        self.num_preemptions = 0
        self.max_background_seqs = config.max_background_seqs
        self.max_background_tokens = config.max_background_tokens
        self._foreground: tuple[float, float] | None = None     # (the lowest value seen, when last seen)
        spec = config.speculative_config
        self.proposer = make_proposer(spec) if spec is not None else None
        self.spec_k = spec.num_speculative_tokens if spec is not None else 0
        # the model's own MTP head drafts, in the runner after each step (runner/mtp_drafter.py): the steps carry what
        # its pass needs, a request that samples gets lookahead blocks for the chain, the drafts come back with the
        # sampled tokens and wait in the proposer (spec_decode/mtp.py)
        self.mtp = spec is not None and spec.method == "mtp"
        self.spec_max_running = (spec.disable_by_batch_size if spec is not None else None) or config.max_num_seqs
        # a step's rows stay within the largest compiled decode bucket (a speculating request is 1 + k decode
        # rows): drafts beyond it would make the step run eagerly
        self.spec_max_rows = max(config.compile_batch_sizes, default=32)
        # speculative decoding's counters (vLLM's spec_decode metrics), cumulative
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * self.spec_k
        self.lora = lora_slots         # None: LoRA off
        self.failed: list[EngineOutput] = []      # requests failed while waiting (an adapter unreadable): for the core

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        prefill_tokens = self._prefill_tokens()    # over the requests running as the step starts, before any give way
        yield_above = self._make_way(out)
        budget = self._step_budget(prefill_tokens)
        out_of_blocks = self._schedule_running(budget, yield_above, out)
        # no request is admitted in a step that preempted for blocks
        if not out_of_blocks and self.waiting.admits(self.running):
            self._schedule_waiting(budget, out)
        if out.scheduled:
            if self.mtp:
                self._allocate_lookahead(out.scheduled)
            # decodes first (stable), speculating requests among them: their rows are decode rows
            out.rows = sorted(out.scheduled, key=lambda s: s.num_new_tokens > 1 and not s.draft_token_ids)
            out.step = self._model_step(out.rows)
        return out

    def _allocate_lookahead(self, scheduled: list[ScheduledRequest]) -> None:
        """MTP drafting's chain writes the head's KV at up to (drafts wanted - 1) positions past a sampling request's
        last computed one: blocks for them where free blocks remain once the step is scheduled (never a preemption; a
        request without them gets fewer drafts). They are the blocks its next step would take anyway."""
        for s in scheduled:
            req = self.requests[s.request_id]
            extra = min(self._mtp_drafts_wanted(req, s) - 1,
                        self.max_model_len - (s.num_computed_tokens + s.num_new_tokens))
            if extra > 0:
                self.kv.allocate_slots(req, s.num_new_tokens + extra)

    def _mtp_drafts_wanted(self, req: Request, s: ScheduledRequest) -> int:
        """How many drafts the MTP head should make after the token this step samples for `req`: as many as its next
        step could verify (`_drafts`' bounds, one token on); 0 where it will not speculate then (nothing sampled, a
        grammar, no room, more requests running than speculate: the head's logits would be wasted)."""
        if not s.samples or not self._may_draft(req) or len(self.running) > self.spec_max_running:
            return 0
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 2
        return max(0, min(self.spec_k, room))

    def _prefill_tokens(self) -> int:
        """The step's prompt tokens: `max_prefill_tokens_while_decoding` while a running request is generating (a
        decode: one token to compute, some output already), else the whole budget."""
        cap = self.max_prefill_tokens_while_decoding
        decoding = cap > 0 and any(r.num_output_tokens > 0 and r.num_tokens - r.num_computed_tokens == 1
                                   for r in self.running)
        return cap if decoding else self.max_num_batched_tokens

    def _make_way(self, out: SchedulerOutput) -> int | None:
        """A waiting request of a lower value than running ones: they give way (preempted if it would not fit, and
        left out of the step it is admitted in, so its first token costs what it would without them). The value
        above which running requests sit out this step; None when none do."""
        if not (self.waiting and self.running and self.waiting.peek().priority < self.running[-1].priority):
            return None
        head = self.waiting.peek()
        self._preempt_for(head, out)
        return head.priority

    def _step_budget(self, prefill_tokens: int) -> StepBudget:
        """This step's budget; draft rows only while few enough requests run to speculate (`disable_by_batch_size`),
        up to the largest compiled decode bucket."""
        speculate = self.proposer is not None and len(self.running) <= self.spec_max_running
        return StepBudget(tokens=self.max_num_batched_tokens, prefill_tokens=prefill_tokens,
                          background_above=self._background_above(), background_rows=self.max_background_seqs,
                          background_tokens=self.max_background_tokens or self.max_num_batched_tokens,
                          draft_rows=self.spec_max_rows - len(self.running) if speculate else 0)

    def _schedule_running(self, budget: StepBudget, yield_above: int | None, out: SchedulerOutput) -> bool:
        """The running requests, in order: a decode costs one token (or 1 + its drafts), an unfinished prompt
        (or recompute) a chunk of what is left. A request that needs a block when none is free preempts the last
        running request (itself, if it is the last). Whether any was preempted for blocks."""
        out_of_blocks = False
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            req = self.running[i]
            if yield_above is not None and req.priority > yield_above:
                break                                          # the rest are of higher values too (sorted)
            room = budget.take_row(req)
            if room <= 0:
                break                                          # the rest are of the same or higher values (sorted)
            remaining = req.num_tokens - req.num_computed_tokens
            num_new = min(remaining, room)
            prefill = remaining > 1                            # a prompt (or recompute) chunk, not a decode
            if prefill:
                num_new = min(num_new, budget.prefill_tokens)
                if num_new <= 0:
                    i += 1
                    continue
            elif budget.draft_rows > 0 and room > 1:
                drafts = self._drafts(req, min(room - 1, budget.draft_rows))
                if drafts and self._snapshot_drafts(req, drafts) and self.kv.allocate_slots(req, 1 + len(drafts)):
                    out.scheduled.append(self._scheduled(req, 1 + len(drafts), drafts))
                    budget.take(req, 1 + len(drafts), num_drafts=len(drafts))
                    i += 1
                    continue
                if drafts and self.kv.state is not None:
                    self.kv.state.accepted(req, len(drafts), len(drafts))     # not speculating: snapshots back
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                out_of_blocks = True
                if victim is req:
                    break                                      # it was the last: the loop ends
            else:
                out.scheduled.append(self._scheduled(req, num_new))
                budget.take(req, num_new, prefill=prefill)
                i += 1
        return out_of_blocks

    def _schedule_waiting(self, budget: StepBudget, out: SchedulerOutput) -> None:
        """Admit waiting requests, in the queue's order, while the budget, `max_num_seqs` and the free blocks allow;
        each starts after its prefix-cache hits, and its first chunk runs in this step."""
        busy = self._busy_adapters() if self.lora is not None else None
        whole = self.waiting.admits_whole_prompts     # static: blocks for the whole prompt, past the prompt budget
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek() if busy is None else self._next_admissible(busy)
            if req is None:
                break
            if not whole and min(budget.tokens, budget.prefill_tokens) <= 0:
                break
            room = budget.take_row(req)
            if room <= 0:
                break                                             # the rest wait in priority order: above 0 too
            queried = self.kv.caches(req) and self._takes_prefix_hits(req)
            computed_blocks, num_cached = self.kv.get_computed_blocks(req) if queried else ([], 0)
            remaining = req.num_tokens - num_cached
            num_new = min(remaining, room, budget.prefill_tokens)
            if self.whole_prompts and num_new < remaining:
                if out.scheduled:
                    break                      # the next step takes it whole
                num_new = remaining            # alone in its step: past the caps rather than never
            req.num_computed_tokens = num_cached
            if not self.kv.allocate_slots(req, remaining if whole else num_new, computed_blocks):
                req.num_computed_tokens = 0
                break
            if queried:
                self.kv.record_prefix_query(req, num_cached)
            if busy is None:
                self.waiting.popleft()
            else:
                self._take_waiting(req)
                if req.lora is not None:
                    self.lora.place(req.lora, busy)       # can_place said yes this step
                    busy.add(req.lora.lora_int_id)
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_cached
                req.first_scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            if self.running and self.running[-1].priority > req.priority:    # before the higher values
                self.running.insert(bisect.bisect_right(self.running, req.priority, key=_priority), req)
            else:
                self.running.append(req)
            if num_new > 0:
                out.scheduled.append(self._scheduled(req, num_new))
                budget.take(req, num_new, prefill=True)

    # ---- LoRA ----------------------------------------------------------------------------------
    def _busy_adapters(self) -> set[int]:
        """The adapters running requests use: their slots may not change this step."""
        return {r.lora.lora_int_id for r in self.running if r.lora is not None}

    def _next_admissible(self, busy: set[int]) -> Request | None:
        """The first waiting request (in admission order, up to LORA_LOOKAHEAD deep) whose adapter is resident or can
        take a slot this step; None when none can. A request whose adapter cannot be read fails here, alone."""
        for depth, req in enumerate(self.waiting):
            if depth >= LORA_LOOKAHEAD:
                return None
            if req.lora is None or req.lora.lora_int_id in busy:
                return req
            if self.lora.can_place(req.lora, busy):
                try:
                    self.lora.weights(req.lora)        # read now (cached): a missing adapter fails this request
                except Exception as e:  # noqa: BLE001 - the adapter's files went away: this request fails alone
                    self._fail_waiting(req, f"LoRA adapter {req.lora.lora_name!r} could not be read: {e}")
                    return self._next_admissible(busy)
                return req
        return None

    def _take_waiting(self, req: Request) -> None:
        if self.waiting.peek() is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)

    def _fail_waiting(self, req: Request, message: str) -> None:
        self.waiting.remove(req)
        self.requests.pop(req.request_id, None)
        self.kv.free(req)
        req.status, req.stop_reason = RequestStatus.FINISHED_ERROR, message
        self.failed.append(self._output(req, [], None, None))

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """The names of the adapters of running and of waiting requests (vLLM's lora_requests_info labels)."""
        running = sorted({r.lora.lora_name for r in self.running if r.lora is not None})
        waiting = sorted({r.lora.lora_name for r in self.waiting if r.lora is not None})
        return running, waiting

    def _background_above(self) -> float:
        """Requests of a value above this are background this step (capped at max_background_seqs rows): the
        lowest value running or waiting now, or seen within FOREGROUND_GRACE_S; infinity when nothing is."""
        lowest = min(self.running[0].priority if self.running else NO_PRIORITY,
                     self.waiting.peek().priority if self.waiting else NO_PRIORITY)
        now = time.monotonic()
        fg = self._foreground
        if lowest != NO_PRIORITY and (fg is None or lowest <= fg[0] or now - fg[1] > FOREGROUND_GRACE_S):
            self._foreground = fg = (lowest, now)
        return fg[0] if fg is not None and now - fg[1] <= FOREGROUND_GRACE_S else NO_PRIORITY

    def _snapshot_drafts(self, req: Request, drafts: tuple[int, ...]) -> bool:
        """A hybrid's speculating request needs a state snapshot per draft (core/state_cache.py); False when too few
        are free this step (it decodes one token instead)."""
        return self.kv.state is None or self.kv.state.take_snapshots(req, len(drafts)) is not None

    def _drafts(self, req: Request, budget: int) -> tuple[int, ...]:
        """Draft tokens for a decoding request, or () where it may not speculate (`_may_draft`), or no room (every
        draft may become an output token: max_tokens and the context bound how many). A reasoning request's drafts
        stop at the one that ends its reasoning or spends its thinking budget: the row after it is the grammar's
        or forced."""
        if not self._may_draft(req):
            return ()
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        k = min(self.spec_k, room, budget)
        drafts = tuple(self.proposer.propose(req.request_id, req.token_ids, k)[:k]) if k > 0 else ()
        if drafts and req.thinking is not None and req.thinking.in_reasoning:
            drafts = drafts[:req.thinking.drafts_to_verify(drafts)]
        return drafts

    @staticmethod
    def _may_draft(req: Request) -> bool:
        """Whether a request's drafts can be verified: not while a grammar decides its tokens (drafts would need
        the matcher's state after each) or a token is forced, nor for an embedding. A reasoning request's grammar
        starts after its reasoning: it drafts while it reasons freely."""
        if req.pooling is not None:
            return False
        if req.thinking is not None and req.thinking.in_reasoning:
            return req.thinking.free
        return req.matcher is None

    def _preempt_for(self, head: Request, out: SchedulerOutput) -> None:
        """Preempt running requests of a higher priority value than the waiting `head` (the newest of the highest
        value first) while `max_num_seqs` or the free blocks would keep `head` waiting. The blocks it needs are
        estimated for its first chunk, without prefix-cache hits (an estimate on the safe side)."""
        need = self.kv.blocks_needed(min(head.num_tokens, self.max_num_batched_tokens))
        while (self.running and self.running[-1].priority > head.priority
               and (len(self.running) >= self.max_num_seqs or self.kv.num_free_blocks < need)):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)

    def _takes_prefix_hits(self, req: Request) -> bool:
        """Whether cached blocks may stand in for the request's first positions: not when it needs something of
        every prompt position (prompt logprobs, as vLLM; mean pooling) or its first (cls pooling)."""
        return req.params.prompt_logprobs is None and not (req.pooling is not None and self.pooling != "last")

    def _model_step(self, scheduled: list[ScheduledRequest]) -> ModelStep:
        token_ids: list[int] = []
        sampling = []
        spans, prompt_rows = [], []
        pooling_spans, pools = [], False
        token_type_starts, pairs = [], False
        num_computed, num_new, tables, samples = [], [], [], []
        lora_slots, any_lora = [], False
        state = self.kv.state
        state_slots, snapshots = [], []
        next_token_ids, verified, wanted = [], [], []        # the MTP drafter's (empty otherwise)
        for s in scheduled:
            req = self.requests[s.request_id]
            table = self.kv.block_tables[s.request_id]
            if self.mtp:
                k = len(s.draft_token_ids)
                wanted += [self._mtp_drafts_wanted(req, s)] * (1 + k)
                if k:                       # every row samples the token after it
                    verified += [k] + [0] * k
                    next_token_ids += [-1] * (1 + k)
                else:                       # a chunk short of the known tokens: the next one follows it
                    end = s.num_computed_tokens + s.num_new_tokens
                    verified.append(0)
                    next_token_ids.append(req.token_ids[end] if not s.samples and end < req.num_tokens else -1)
            if state is not None:
                slot, entry = state.slot(s.request_id), len(num_new)
                if s.draft_token_ids:       # the state after the last token and each draft but the last
                    state_slots += [slot] * (1 + len(s.draft_token_ids))
                    snapshots += [(entry + j, 0, snap) for j, snap in enumerate(state.snapshots[s.request_id])]
                else:
                    state_slots.append(slot)
                    snapshots += [(entry, offset, ckpt) for offset, ckpt in state.plan_checkpoints(
                        req, s.num_computed_tokens, s.num_new_tokens, self.kv.block_size)]
            if self.lora is not None:
                slot = self.lora.slot(req.lora)
                any_lora = any_lora or req.lora is not None
                lora_slots += [slot] * (1 + len(s.draft_token_ids))
            if s.draft_token_ids:     # its last token and each draft: decode rows at consecutive positions
                rows = (req.token_ids[-1],) + s.draft_token_ids
                for j, token in enumerate(rows):
                    token_ids.append(token)
                    num_computed.append(s.num_computed_tokens + j)
                    num_new.append(1)
                    tables.append(table)
                    samples.append(True)
                    sampling.append(self._sampling_row(req, s.draft_token_ids[:j]))
                spans += [(0, 0)] * len(rows)
                pooling_spans += [(0, 0)] * len(rows)
                token_type_starts += [-1] * len(rows)
                continue
            num_computed.append(s.num_computed_tokens)
            num_new.append(s.num_new_tokens)
            tables.append(table)
            samples.append(s.samples)
            token_ids += req.token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens]
            if s.samples:
                sampling.append(self._sampling_row(req))
            span = self._prompt_logprob_span(req, s)
            spans.append(span)
            if span[1]:
                first = s.num_computed_tokens + span[0]
                prompt_rows.append(PromptLogprobsRow(req.prompt_token_ids[first + 1:first + 1 + span[1]],
                                                     req.params.prompt_logprobs))
            pooling_span = self._pooling_span(req, s) if req.pooling is not None else (0, 0)
            pooling_spans.append(pooling_span)
            pools = pools or pooling_span[1] > 0
            start = req.pooling.token_type_start if req.pooling is not None else None
            token_type_starts.append(-1 if start is None else start)
            pairs = pairs or start is not None
        batch = StepBatch(num_decodes=sum(n == 1 for n in num_new), token_ids=token_ids,
                          num_computed_tokens=num_computed, num_new_tokens=num_new, block_tables=tables,
                          samples=samples,
                          prompt_logprob_spans=tuple(spans) if prompt_rows else (),
                          pooling_spans=tuple(pooling_spans) if pools else (),
                          token_type_starts=tuple(token_type_starts) if pairs else (),
                          lora_slots=tuple(lora_slots) if any_lora else (),
                          state_slots=tuple(state_slots), state_copies=state.take_copies() if state else (),
                          state_snapshots=tuple(snapshots), next_token_ids=tuple(next_token_ids),
                          verified_drafts=tuple(verified), drafts_wanted=tuple(wanted))
        return ModelStep(batch, sampling, prompt_rows)

    def _pooling_span(self, req: Request, s: ScheduledRequest) -> tuple[int, int]:
        """(offset in the chunk, count) of the positions an embedding request pools this step: mean, every position
        of the chunk not sent yet (a recompute after a preemption skips what was sent); last, the prompt's last
        position, in the chunk that reaches it."""
        end = s.num_computed_tokens + s.num_new_tokens
        if self.pooling == "cls":
            return (0, 1) if s.num_computed_tokens == 0 and req.num_pooled_tokens == 0 else (0, 0)
        if not self.pool_every_position:
            return (s.num_new_tokens - 1, 1) if end == req.num_prompt_tokens else (0, 0)
        first = max(s.num_computed_tokens, req.num_pooled_tokens)
        return (first - s.num_computed_tokens, end - first) if end > first else (0, 0)

    @staticmethod
    def _prompt_logprob_span(req: Request, s: ScheduledRequest) -> tuple[int, int]:
        """(offset in the chunk, count) of the positions whose logits give prompt logprobs not yet sent: position j
        predicts prompt token j + 1, so j runs up to the prompt's second-to-last token (a recompute after a
        preemption skips what was sent)."""
        if req.params.prompt_logprobs is None:
            return 0, 0
        first = max(s.num_computed_tokens, req.num_prompt_logprobs_sent)
        end = min(s.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens - 1)
        return (first - s.num_computed_tokens, end - first) if end > first else (0, 0)

    @staticmethod
    def _sampling_row(req: Request, drafts: tuple[int, ...] = ()) -> SamplingRow:
        """The row sampling the request's next token; with `drafts`, the one after them (speculative decoding's
        target at that position: penalties, min_tokens and the seed as if they had been sampled)."""
        p = req.params
        num_output = req.num_output_tokens + len(drafts)
        blocked: tuple[int, ...] = ()
        if num_output < p.min_tokens:          # EOS and stop ids may not end it yet
            blocked = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(req.eos_token_ids))
        seed = None
        if p.seed is not None:     # a fresh, reproducible seed per position (see Sampler)
            seed = (p.seed * 6364136223846793005 + num_output * 1442695040888963407) % 2**64
        token_ids = req.token_ids + list(drafts) if drafts else req.token_ids
        thinking = req.thinking
        if thinking is None:
            return SamplingRow(p, token_ids, req.num_prompt_tokens, blocked, seed, req.matcher)
        if drafts:
            thinking = thinking.after(drafts)
        # the grammar masks the answer only; a matcher is still fresh at the row after the drafts that end the
        # reasoning (`_drafts` stops there)
        return SamplingRow(p, token_ids, req.num_prompt_tokens, blocked, seed,
                           None if thinking.in_reasoning else req.matcher, thinking.forced_token())

    @staticmethod
    def _scheduled(req: Request, num_new: int, drafts: tuple[int, ...] = ()) -> ScheduledRequest:
        return ScheduledRequest(req.request_id, req.num_computed_tokens, num_new,
                                samples=req.num_computed_tokens + num_new == req.num_tokens + len(drafts)
                                and req.pooling is None, draft_token_ids=drafts)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        req.num_preemptions += 1

    # ---- after the model ran -------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: SampledTokens) -> list[EngineOutput]:
        """Advance computed tokens, append the sampled tokens (in sampling-row order), finish requests.
        Returns one output per request that sampled, and one per prompt chunk computed of a request that asks for
        its progress (return_progress) or its prompt logprobs."""
        outputs = []
        finished = []
        k = 0          # the next sampling row
        b = 0          # the next batch row (a speculating request has several)
        spans = out.step.batch.prompt_logprob_spans if out.step is not None else ()
        pooling_spans = out.step.batch.pooling_spans if out.step is not None else ()
        prompt_logprobs = iter(sampled.prompt_logprobs)
        pooled = iter(sampled.pooled)
        for s in out.rows:
            req = self.requests[s.request_id]
            i, b = b, b + 1 + len(s.draft_token_ids)
            if s.draft_token_ids:
                n = 1 + len(s.draft_token_ids)
                tokens, logprobs = sampled.token_ids[k:k + n], sampled.logprobs[k:k + n]
                error = next((sampled.errors[j] for j in range(k, k + n) if j in sampled.errors), None)
                output = self._accept(req, s, tokens, logprobs, error, finished)
                outputs.append(output)
                self._keep_drafts(req, k + len(output.new_token_ids) - 1, sampled)    # its last accepted row's
                k += n
                continue
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(req)
            new_prompt_logprobs = None
            if spans and spans[i][1]:
                new_prompt_logprobs = next(prompt_logprobs)
                req.num_prompt_logprobs_sent += len(new_prompt_logprobs)
            if req.pooling is not None:
                offset, count = pooling_spans[i] if pooling_spans else (0, 0)
                if count:
                    req.num_pooled_tokens = s.num_computed_tokens + offset + count
                if req.num_computed_tokens == req.num_prompt_tokens:     # its last chunk: done, nothing to sample
                    req.status = RequestStatus.FINISHED_STOPPED
                    finished.append(req)
                if count or req.status.finished:
                    outputs.append(EngineOutput(
                        req.request_id, [], pooled_sum=next(pooled) if count else None, num_pooled=count,
                        finish_reason=req.finish_reason, num_prompt_tokens=req.num_prompt_tokens,
                        num_cached_tokens=req.num_cached_tokens, first_scheduled_time=req.first_scheduled_time,
                        queued_time=req.queued_time, num_preemptions=req.num_preemptions))
                continue
            if not s.samples:
                if new_prompt_logprobs or req.return_progress:
                    outputs.append(EngineOutput(req.request_id, [], prompt_logprobs=new_prompt_logprobs,
                                                num_prompt_tokens=req.num_prompt_tokens,
                                                num_cached_tokens=req.num_cached_tokens,
                                                first_scheduled_time=req.first_scheduled_time,
                                                num_computed_tokens=req.num_computed_tokens))
                continue
            token, logprobs, error = sampled.token_ids[k], sampled.logprobs[k], sampled.errors.get(k)
            new_tokens = self._append(req, [token], error)
            self._keep_drafts(req, k, sampled)
            k += 1
            if req.status.finished:
                finished.append(req)
            outputs.append(self._output(req, new_tokens, [logprobs] if logprobs is not None else None,
                                        new_prompt_logprobs))
        if finished:
            self.running = [r for r in self.running if not r.status.finished]
            for req in finished:
                self.kv.free(req)
                del self.requests[req.request_id]
                if self.proposer is not None and req.status != RequestStatus.FINISHED_ERROR:
                    self.proposer.finished(req.request_id, req.token_ids, req.num_prompt_tokens)
                if self.mtp:
                    self.proposer.forget(req.request_id)
        return outputs

    def _keep_drafts(self, req: Request, row: int, sampled: SampledTokens) -> None:
        """MTP: the drafts the runner made after sampling row `row` (the request's last token) wait in the proposer
        for the request's next step."""
        if self.mtp and not req.status.finished:
            self.proposer.drafted(req.request_id, req.num_tokens, sampled.draft_token_ids.get(row, ()))

    def _accept(self, req: Request, s: ScheduledRequest, targets: list[int], logprobs: list, error: str | None,
                finished: list[Request]) -> EngineOutput:
        """Speculative decoding's verification. Row j sampled the target token after the last token and drafts
        1..j, exactly as a decode step would have (same logits, penalties, seed for that position): the drafts
        are accepted while they equal the targets, and the targets up to the first mismatch (or one past the last
        draft) are the new tokens. Every new token is thus what decoding one token at a time samples, so greedy
        output is unchanged, and so is the distribution when sampling: the proposers' drafts are deterministic
        (a one-hot draft distribution), for which this is the speculative-sampling rule — accept draft x with
        probability p(x), else sample from p without x. The KV of rejected drafts stays in slots past
        num_computed_tokens, overwritten by the next step (its blocks are reused, not freed)."""
        drafts = s.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and targets[accepted] == drafts[accepted]:
            accepted += 1
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += len(drafts)
        self.spec_num_accepted_tokens += accepted
        for j in range(accepted):
            self.spec_accepted_per_pos[j] += 1
        if self.kv.state is not None:     # a hybrid: the state after the last accepted token, for its next step
            self.kv.state.accepted(req, accepted, len(drafts))
        new_tokens = self._append(req, targets[:accepted + 1], error)
        # the KV is right for the last token and the accepted drafts; the new tokens up to the last are known
        req.num_computed_tokens = min(s.num_computed_tokens + 1 + accepted, req.num_tokens - 1)
        self.kv.cache_full_blocks(req)
        if req.status.finished:
            finished.append(req)
        lps = logprobs[:len(new_tokens)]
        return self._output(req, new_tokens, lps if new_tokens and lps[0] is not None else None, None)

    def _append(self, req: Request, tokens: list[int], error: str | None) -> list[int]:
        """Append sampled tokens one by one, stopping at the first that finishes the request; the ones appended."""
        if error is not None:
            req.status, req.stop_reason = RequestStatus.FINISHED_ERROR, error
            return []
        for n, token in enumerate(tokens, 1):
            req.token_ids.append(token)
            answer = req.thinking is None or req.thinking.accept(token)    # the reasoning's tokens: not the grammar's
            req.status = (answer and self._check_grammar(req, token)) or self._check_stop(req, token) or req.status
            if req.status.finished:
                return tokens[:n]
        return tokens

    @staticmethod
    def _output(req: Request, new_tokens: list[int], new_logprobs, prompt_logprobs) -> EngineOutput:
        return EngineOutput(
            req.request_id, new_tokens, new_logprobs=new_logprobs, prompt_logprobs=prompt_logprobs,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens, first_scheduled_time=req.first_scheduled_time,
            queued_time=req.queued_time, num_preemptions=req.num_preemptions,
            num_computed_tokens=req.num_computed_tokens)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not p.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED         # stop_reason stays None, as vLLM
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _check_grammar(req: Request, token: int) -> RequestStatus | None:
        """Feed a constrained request's token to its matcher; done once the grammar is complete."""
        if req.matcher is None:
            return None
        if not req.matcher.accept(token):   # the mask allowed it, so this is a bug: fail loudly, this request only
            req.stop_reason = f"the grammar rejected sampled token {token}: {req.matcher.error}"
            return RequestStatus.FINISHED_ERROR
        if req.matcher.is_terminated():     # EOS taken, or nothing but EOS may follow: stop without that step
            return RequestStatus.FINISHED_STOPPED
        return None

    def abort(self, request_ids) -> list[EngineOutput]:
        """Remove unfinished requests wherever they are and free their blocks; their final outputs. O(queue
        length) per request, at most max_num_seqs for the running list: cheap next to a model step."""
        outputs = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self.kv.free(req)
            if self.mtp:
                self.proposer.forget(rid)
            req.status = RequestStatus.FINISHED_ABORTED
            outputs.append(EngineOutput(rid, [], finish_reason="abort", num_prompt_tokens=req.num_prompt_tokens,
                                        num_cached_tokens=req.num_cached_tokens,
                                        first_scheduled_time=req.first_scheduled_time, queued_time=req.queued_time,
                                        num_preemptions=req.num_preemptions))
        return outputs
