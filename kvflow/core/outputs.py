"""The contracts between the parts: what the scheduler hands the runner, what the core hands the frontend."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute `num_new_tokens` tokens starting at `num_computed_tokens`."""
    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    samples: bool          # True when this chunk reaches the end of the known tokens: sample one token


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class EngineOutput:
    """New tokens of one request after one step. `finish_reason` is set on its last output."""
    request_id: str
    new_token_ids: list[int]
    # one dict per new token: {token_id: logprob} of the top-k plus the sampled token, when logprobs were asked
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id, when one ended the request
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
