"""OutputProcessor: the frontend's one path from the core's token ids to what a caller sees. Used by both the
offline `LLM` and the serving `AsyncEngine` (on its event loop).

Per request it keeps the choices (`n > 1` fans out into core requests `"{id}-{i}"`, seeded `seed + i`), each
with its incremental detokenizer, stop strings, text, tokens, logprobs and timings. `process()` turns one
step's `EngineOutput`s into per-request `CompletionDelta`s and says which core requests to abort (a stop
string matched). An exception while handling one request's outputs fails that request only. The text of the EOS or
stop token id that ended a choice is left out of its text (kept with include_stop_str_in_output), as vLLM does; its
token id and logprobs stay.

An embedding request (`pooling`) has no text: its outputs carry sums of pooled hidden states, added up here
(float64) until the last one, whose delta carries the finished vector, or a score request's [score]
(`CompletionDelta.embedding`, finished by `PoolingParams.output`).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np

from kvflow.core.messages import AddRequest
from kvflow.core.outputs import EngineOutput
from kvflow.detokenizer import IncrementalDetokenizer
from kvflow.metrics import RequestTimings
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger("kvflow")


@dataclass(frozen=True)
class PromptProgress:
    """How far a request's prompt is (llama-server's `prompt_progress`): of its `total` tokens, `cache` came from the
    prefix cache and `processed` have their KV (the cached ones included); `time_ms` since its first step began."""
    total: int
    cache: int
    processed: int
    time_ms: float


@dataclass(frozen=True)
class CompletionDelta:
    """What one step added to one choice of a request, as text and tokens."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or string; the message when "error"
    # a pooling request's output, on its last delta: an embedding's vector, or a score request's [score]
    embedding: list[float] | None = None
    # return_progress: the prompt's progress after a step that computed some of it (choice 0; the prompt is shared)
    prompt_progress: PromptProgress | None = None


@dataclass
class ChoiceState:
    index: int
    core_id: str
    timings: RequestTimings
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[ChoiceState]
    num_cached_tokens: int = 0
    # with prompt_logprobs: per prompt token, token id -> (logprob, rank); None for the first token (nothing
    # predicts it). Filled as the prompt's chunks are computed (by choice 0: the others share its prompt)
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None
    pooling: PoolingParams | None = None          # an embedding request
    pooled_sum: np.ndarray | None = None          # its pooled hidden states so far, summed (float64)
    num_pooled: int = 0                           # over how many prompt positions
    embedding: list[float] | None = None          # the finished vector
    return_progress: bool = False                 # its prompt's progress goes out (CompletionDelta.prompt_progress)
    num_progress_sent: int = 0                    # prompt tokens the progress sent so far said were processed

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


@dataclass
class ProcessedOutputs:
    deltas: dict[str, list[CompletionDelta]]    # request id -> this step's deltas, in output order
    to_abort: list[str]                         # core ids the core should stop (stop strings, failures)


class OutputProcessor:
    def __init__(self, tokenizer, keep_logprobs: bool = False):
        self.tokenizer = tokenizer
        self.keep_logprobs = keep_logprobs        # accumulate logprobs per choice (the offline API returns them)
        self.requests: dict[str, RequestState] = {}
        self._choice_of: dict[str, tuple[RequestState, ChoiceState]] = {}   # core id -> its request and choice

    def add_request(self, request: AddRequest) -> list[AddRequest]:
        """Register a request; returns the core requests to add, one per choice (an embedding request: one): the
        request itself when n = 1, else copies of it as `"{id}-{i}"` with `SamplingParams.child(i)`."""
        request_id, params = request.request_id, request.params
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        state = RequestState(request_id, list(request.prompt_token_ids), params, [],
                             prompt_logprobs=None if params.prompt_logprobs is None else [None],
                             pooling=request.pooling, return_progress=request.return_progress)
        core = []
        for i in range(params.n):
            child = request if params.n == 1 else dataclasses.replace(
                request, request_id=f"{request_id}-{i}", params=params.child(i))
            detok = None if self.tokenizer is None or request.pooling is not None else IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=child.params.skip_special_tokens, stop=child.params.stop,
                include_stop_str_in_output=child.params.include_stop_str_in_output)
            choice = ChoiceState(i, child.request_id, RequestTimings(arrival=request.arrival_time), detok,
                                 logprobs=[] if self.keep_logprobs and child.params.logprobs is not None else None)
            state.choices.append(choice)
            self._choice_of[child.request_id] = (state, choice)
            core.append(child)
        self.requests[request_id] = state
        return core

    def process(self, outputs: list[EngineOutput], step_start: float = 0.0,
                step_end: float = 0.0) -> ProcessedOutputs:
        result = ProcessedOutputs({}, [])
        for out in outputs:
            found = self._choice_of.get(out.request_id)
            if found is None or found[1].finished:
                continue          # aborted by us (stop string, disconnect): its last output is not needed
            state, choice = found
            try:
                delta = self._process_one(state, choice, out, step_start, step_end, result.to_abort)
            except Exception as e:  # noqa: BLE001 - one request's data must not take the others down
                logger.exception("handling the output of %s failed", out.request_id)
                delta = self._fail(choice, f"{type(e).__name__}: {e}", step_end)
                if not out.finished:
                    result.to_abort.append(choice.core_id)
            if delta is not None:
                result.deltas.setdefault(state.request_id, []).append(delta)
        return result

    def _process_one(self, state: RequestState, choice: ChoiceState, out: EngineOutput, t_start: float,
                     t_end: float, to_abort: list[str]) -> CompletionDelta | None:
        t = choice.timings
        if t.scheduled is None and out.first_scheduled_time is not None:
            t.scheduled = out.first_scheduled_time
        if t.queued is None:
            t.queued = out.queued_time
        t.num_preemptions = max(t.num_preemptions, out.num_preemptions)
        if choice.index == 0 and (out.num_cached_tokens or not choice.token_ids):
            state.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason == "error":
            return self._fail(choice, str(out.stop_reason or "the engine failed on this request"), t_end)
        if out.prompt_logprobs and state.prompt_logprobs is not None:
            state.prompt_logprobs += out.prompt_logprobs
        if state.pooling is not None:
            return self._pooled(state, choice, out, t_end)
        progress = self._progress(state, choice, out, t_end)
        new_ids = list(out.new_token_ids)
        if new_ids:
            if t.first_token is None:
                t.first_token = t_end
                if t.scheduled is None:
                    t.scheduled = t_start
            t.last_token = t_end
            t.token_times.extend([t_end] * len(new_ids))
            choice.token_ids += new_ids
            if choice.logprobs is not None and out.new_logprobs:
                choice.logprobs += out.new_logprobs
        text = ""
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        detok = choice.detokenizer
        if detok is not None:
            if new_ids:
                text = detok.add(new_ids, stop_terminated=self._ended_on_token(out, new_ids[-1]))
            if detok.stopped:
                if finish_reason is None:     # end this choice here and free its KV blocks in the core
                    to_abort.append(choice.core_id)
                finish_reason, stop_reason = "stop", detok.stop_str
            elif finish_reason is not None:
                text += detok.flush()
        choice.text += text
        if finish_reason is not None:
            choice.finish_reason, choice.stop_reason = finish_reason, stop_reason
            t.finished = t_end
        if not text and not new_ids and finish_reason is None and progress is None:
            return None
        return CompletionDelta(choice.index, text, new_ids, out.new_logprobs, finish_reason, stop_reason,
                               prompt_progress=progress)

    @staticmethod
    def _progress(state: RequestState, choice: ChoiceState, out: EngineOutput, when: float) -> PromptProgress | None:
        """return_progress: the prompt's progress, when this output says it went further than the last one sent (a
        preemption computes the prompt again: that is not sent twice)."""
        if not state.return_progress or choice.index != 0:
            return None
        processed = min(out.num_computed_tokens, state.num_prompt_tokens)
        if processed <= state.num_progress_sent:
            return None
        state.num_progress_sent = processed
        start = choice.timings.scheduled if choice.timings.scheduled is not None else when
        return PromptProgress(state.num_prompt_tokens, min(out.num_cached_tokens, processed), processed,
                              max(0.0, when - start) * 1000)

    def _ended_on_token(self, out: EngineOutput, last_token: int) -> bool:
        """Whether the core ended this request because its last token is EOS or a stop token id (vLLM's
        `stop_terminated`), whose text the detokenizer then leaves out. Not when a grammar ended it on a token of its
        text (the core stops a constrained request once nothing but EOS may follow)."""
        return out.finish_reason == "stop" and (
            last_token == out.stop_reason or (out.stop_reason is None and last_token in self.tokenizer.eos_token_ids))

    @staticmethod
    def _pooled(state: RequestState, choice: ChoiceState, out: EngineOutput, when: float) -> CompletionDelta | None:
        """An embedding request's output: add its pooled sum; on the last one, finish the vector. Its vector is its
        first (and only) result, so the metrics see it as a first token at that time."""
        if out.pooled_sum is not None:
            chunk = np.asarray(out.pooled_sum, dtype=np.float64)
            state.pooled_sum = chunk if state.pooled_sum is None else state.pooled_sum + chunk
            state.num_pooled += out.num_pooled
        if out.finish_reason is None:
            return None
        t = choice.timings
        if out.finish_reason == "stop":
            if state.pooled_sum is None:
                raise RuntimeError("the engine finished an embedding request without pooling any position")
            state.embedding = state.pooling.output(state.pooled_sum, state.num_pooled)
            t.first_token = t.last_token = when
            if t.scheduled is None:
                t.scheduled = when
        t.finished = when
        choice.finish_reason = out.finish_reason
        return CompletionDelta(choice.index, "", [], finish_reason=out.finish_reason, embedding=state.embedding)

    @staticmethod
    def _fail(choice: ChoiceState, message: str, when: float) -> CompletionDelta:
        choice.finish_reason, choice.stop_reason = "error", message
        choice.timings.finished = when
        return CompletionDelta(choice.index, "", [], None, "error", message)

    def request_of(self, core_id: str) -> RequestState | None:
        found = self._choice_of.get(core_id)
        return None if found is None else found[0]

    def finish(self, request_id: str, reason: str = "abort", when: float = 0.0) -> list[str]:
        """Forget a request; its unfinished choices end with `reason`. Returns their core ids (to abort)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        unfinished = []
        for c in state.choices:
            self._choice_of.pop(c.core_id, None)
            if not c.finished:
                c.finish_reason = reason
                c.timings.finished = when
                unfinished.append(c.core_id)
        return unfinished
