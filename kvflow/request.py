"""Request: one sequence's tokens, progress and status as the engine core sees it (token ids only)."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from kvflow.lora_request import LoRARequest
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvflow.structured_output import Matcher


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


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, arrival_time: float | None = None, pooling: PoolingParams | None = None,
                 priority: int = 0, lora: LoRARequest | None = None, cache_prefix: bool = False):
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
