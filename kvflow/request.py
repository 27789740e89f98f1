"""A request in the engine core: `AddRequest`, the one record of it from the frontend to the core, and `Request`,
one sequence's tokens, progress and status as the core runs it (token ids only), built from that record.

A new per-request field touches three rooms: this file (the `AddRequest` field, and its copy on `Request`: an
`__init__` argument `from_add_request` passes), the frontend that fills it (the server's `OpenAIServing.submit`, the
offline `LLM`), and the core that reads it. The rooms between (`AsyncEngine.submit`, the output processor's fan-out
of n > 1, the engine process's inbox, `EngineCore.add_request`) pass the record on whole."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.lora_request import LoRARequest
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvflow.structured_output import Matcher
    from kvflow.structured_output.thinking import ThinkingState


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # everything from here on is finished
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6           # this request's data failed (sampling): it ends alone, the engine goes on

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class AddRequest:
    """One request on its way from the frontend to the engine core (vLLM's EngineCoreRequest), sent as the message
    `core/messages.py` names. The frontend fills it; the output processor fans a request of `n` > 1 out into one
    per choice (`"{id}-{i}"`, `SamplingParams.child`) before the core sees it, so the core takes `n` = 1 only."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)   # wall clock (time.time()), stamped on arrival
    max_tokens: int | None = None     # resolved by the frontend's validator, which admitted it: not checked again
    pooling: PoolingParams | None = None   # an embedding request: pooled hidden states, no sampling
    priority: int = 0                 # the scheduler's: a lower value first (interactive 0, batch work higher)
    lora: LoRARequest | None = None   # the LoRA adapter it runs under (the engine reads it from its path when needed)
    cache_prefix: bool = False        # prefix caching for this request even when the engine's is off (beam search)
    # an output after each prompt chunk it computes, saying how far its prompt is (llama-server's return_progress)
    return_progress: bool = False


class Request:
    """One n = 1 request as the core runs it. EngineCore builds it from the frontend's record
    (`from_add_request`); the scheduler's tests build one directly."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, arrival_time: float | None = None, pooling: PoolingParams | None = None,
                 priority: int = 0, lora: LoRARequest | None = None, cache_prefix: bool = False,
                 return_progress: bool = False):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)   # prompt + generated
        self.params = params
        self.max_tokens = max_tokens              # resolved: never None here
        self.priority = priority                  # vLLM's: a lower value is scheduled first (batch work: 10)
        self.lora = lora                          # the LoRA adapter it runs under (None: the base model)
        # its full blocks join the prefix cache and it takes prefix-cache hits even when the engine's prefix caching
        # is off (beam search's one-token steps: every beam shares its prompt's blocks, beam_search.py)
        self.cache_prefix = cache_prefix
        self.return_progress = return_progress    # an output after each prompt chunk too (AddRequest's)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0              # tokens whose KV is in the cache
        self.num_cached_tokens = 0                # prompt tokens that came from the prefix cache
        self.num_prompt_logprobs_sent = 0         # prompt positions whose logprobs went out (kept over preemption)
        # an embedding request: prefill only, its pooled hidden states go out, it samples nothing
        self.pooling = pooling
        self.num_pooled_tokens = 0                # prompt positions whose hidden states went out (kept over preemption)
        self.stop_reason: int | str | None = None    # the stop token id; the message when FINISHED_ERROR
        # wall-clock seconds (time.time()), the clock the server stamps requests with on arrival
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.first_scheduled_time: float | None = None
        # entered the core's waiting queue (vLLM's QUEUED event): queue time counts from here to first_scheduled_time
        self.queued_time = time.time()
        self.num_preemptions = 0                  # times the scheduler took its KV away (vLLM's Request field)
        self.eos_token_ids: frozenset[int] = frozenset()  # set by the engine from the tokenizer/model
        # the grammar state of a constrained request, fed every sampled token. Preemption keeps the generated
        # tokens (recompute rebuilds only their KV), so it never needs rewinding.
        self.matcher: Matcher | None = (params.structured.matcher() if params.structured is not None else None)
        # where its reasoning ends (a reasoning model's grammar or thinking budget): fed every output token before
        # the matcher, which takes only the answer's (structured_output/thinking.py)
        self.thinking: ThinkingState | None = params.thinking.state() if params.thinking is not None else None

    @classmethod
    def from_add_request(cls, add: AddRequest, eos_token_ids: frozenset[int] = frozenset()) -> Request:
        """The core's request from the frontend's record; its `max_tokens` must be resolved (admitted)."""
        if add.max_tokens is None:
            raise ValueError(f"request {add.request_id!r} has no resolved max_tokens: admit it first")
        req = cls(add.request_id, add.prompt_token_ids, add.params, add.max_tokens, add.arrival_time, add.pooling,
                  add.priority, add.lora, add.cache_prefix, add.return_progress)
        req.eos_token_ids = eos_token_ids
        return req

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
