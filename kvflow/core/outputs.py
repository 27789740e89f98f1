"""The contracts around the core: what the scheduler decides for a step, what the core hands the frontend,
and the per-step numbers the metrics read."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.runner.step import ModelStep


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: compute `num_new_tokens` tokens starting at `num_computed_tokens`."""
    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    samples: bool          # True when this chunk reaches the end of the known tokens: sample one token
    # speculative decoding: the draft tokens after the last known one. Such a request is `1 + len(drafts)` decode
    # rows in the step (its last token and each draft, at consecutive positions, each sampling a target token);
    # num_new_tokens counts them all
    draft_token_ids: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)   # in the order they were chosen
    preempted_ids: list[str] = field(default_factory=list)
    rows: list[ScheduledRequest] = field(default_factory=list)        # the same in batch order: decodes first
    step: ModelStep | None = None      # the runner's input, built from `rows`

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(frozen=True)
class EngineOutput:
    """New tokens (or pooled hidden states) of one request after one step. `finish_reason` is set on its last
    output."""
    request_id: str
    new_token_ids: list[int]
    # one dict per new token: {token_id: logprob} of the top-k plus the sampled token, when logprobs were asked
    new_logprobs: list[dict[int, float]] | None = None
    # the logprobs of prompt tokens this step computed (prompt_logprobs asked): one dict per position, token id ->
    # (logprob, rank); the prompt's first token has none
    prompt_logprobs: list[dict[int, tuple[float, int]]] | None = None
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or an error message; None on EOS (as vLLM)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None   # when the scheduler first admitted it (ends its queue time)
    queued_time: float | None = None            # when it entered the core's waiting queue (starts its queue time)
    num_preemptions: int = 0                    # how often it was preempted so far
    # its tokens whose KV is computed after this step (return_progress: how far its prompt is; 0 where not said)
    num_computed_tokens: int = 0
    # an embedding request: the sum of the final hidden states of the `num_pooled` prompt positions this step pooled
    # (the frontend adds them up over the chunks and divides: PoolingParams.embedding)
    pooled_sum: list[float] | None = None
    num_pooled: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepStats:
    """The engine after one step (or an idle look): gauges as they are now, counters as this step's deltas."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prompt_tokens_computed: int = 0     # prompt tokens computed (not served from the prefix cache)
    num_generated_tokens: int = 0
    batch_size: int = 0                     # requests in the step (0: no step ran)
    num_batched_tokens: int = 0             # tokens the model computed (prompt chunks + one per decode)
    # what vLLM's vllm:iteration_tokens_total observes for this step: the whole prompt of every request whose
    # first output came this step, plus every token sampled; None when no request had an output (vLLM then
    # observes nothing)
    iteration_tokens: int | None = None
    duration_s: float = 0.0
    compiled_decode_buckets_ready: int = 0  # compiled decode graphs loaded (runner/compiled_decode.py)
    compiled_decode_buckets_total: int = 0  # buckets asked for (0: compiled decode off)
    # speculative decoding, this step's deltas (vLLM's SpecDecodingStats): requests that speculated, draft tokens
    # proposed, of those accepted, and accepted per draft position (1st, 2nd, ...)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # LoRA (enable_lora): max_loras, and the adapters of running and of waiting requests (vLLM's
    # vllm:lora_requests_info); max_lora 0: LoRA is off
    max_lora: int = 0
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
