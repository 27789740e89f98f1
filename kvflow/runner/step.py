"""The runner's whole input and output for one step. The scheduler builds a `ModelStep`; the runner turns it
into tensors, runs the model and samples; nothing here refers to requests or the KV cache manager.

Rows are in batch order: decodes first (one token each, attended in one batched call), then prefill chunks.
`StepBatch` is what every tensor-parallel rank needs (plain lists, cheap to pickle); `sampling` is only for
rank 0, one entry per row that samples, in the same order (it holds live grammar matchers: never pickled).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvflow.structured_output import Matcher


@dataclass(frozen=True)
class StepBatch:
    num_decodes: int
    token_ids: list[int]                # the flat batch's input ids: this step's chunk of each row
    num_computed_tokens: list[int]      # per row: tokens already in the KV cache (the chunk's first position)
    num_new_tokens: list[int]
    block_tables: list[list[int]]
    samples: list[bool]                 # per row: does this chunk end at the last known token (sample one)?
    # per row: (offset in the chunk, count) of the positions whose logits give prompt logprobs; empty: none this step
    prompt_logprob_spans: tuple[tuple[int, int], ...] = ()
    # per row: (offset in the chunk, count) of the positions whose final hidden states an embedding request pools
    # (summed: the scheduler picks the positions, the frontend divides); empty: no row pools this step
    pooling_spans: tuple[tuple[int, int], ...] = ()
    # encoders: per row, the prompt position from which token_type_ids are 1 (a text pair's second text; -1: all 0);
    # empty: every row's are 0
    token_type_starts: tuple[int, ...] = ()
    # per row: the LoRA slot its request's adapter sits in (-1: the base model); empty: no row has an adapter (or
    # LoRA is off)
    lora_slots: tuple[int, ...] = ()
    # models with recurrent layers (hybrids; empty otherwise). Per row: its request's state slot (consecutive rows with
    # the same slot form one run: a speculating request's rows); before the forward, (source slot, slot) copies of
    # every recurrent layer's state, source -1 zeroing the slot (a fresh request; a prefix-cache hit restores its
    # checkpoint; a rejected draft its snapshot); during it, (row, offset in its chunk, slot) snapshots: the state
    # after that position goes to that slot
    state_slots: tuple[int, ...] = ()
    state_copies: tuple[tuple[int, int], ...] = ()
    state_snapshots: tuple[tuple[int, int, int], ...] = ()
    # speculative decoding with the model's own MTP head (runner/mtp_drafter.py; empty otherwise). Per row: the token
    # after its chunk's last position where the scheduler knows it (a prompt chunk short of the prompt's end), -1 where
    # the row samples it (or nothing follows: an embedding request's last chunk); how many of the rows after it are
    # its request's drafts under verification (a speculating request's first row: k; 0 elsewhere); and how many
    # drafts to make after the token it samples should it end its request's step (0: the request will not speculate
    # next step: a grammar, no room, more requests running than speculate)
    next_token_ids: tuple[int, ...] = ()
    verified_drafts: tuple[int, ...] = ()
    drafts_wanted: tuple[int, ...] = ()


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs of one sampling row."""
    params: SamplingParams
    token_ids: list[int]                # prompt + output so far (read only: for penalties)
    num_prompt_tokens: int
    blocked_token_ids: tuple[int, ...]  # may not be sampled yet (EOS and stop ids before min_tokens)
    seed: int | None                    # this step's seed for a seeded request (derived from its position)
    matcher: Matcher | None = None      # the request's grammar state (a reference): masks this row's logits
    forced_token_id: int | None = None  # the token this row must write (a spent thinking budget's end marker)


@dataclass(frozen=True)
class PromptLogprobsRow:
    """One row's prompt positions of this step (its span in `StepBatch.prompt_logprob_spans`): the prompt token
    each position predicts, and how many top log-probabilities to keep per position."""
    target_ids: list[int]
    num_top: int


# one prompt position's log-probabilities: token id -> (logprob, rank), the prompt's own token and the top ones
PromptLogprob = dict[int, tuple[float, int]]


@dataclass(frozen=True)
class ModelStep:
    batch: StepBatch
    sampling: list[SamplingRow]
    prompt_logprobs: list[PromptLogprobsRow] = field(default_factory=list)   # rows with a span, in row order


@dataclass(frozen=True)
class SampledTokens:
    """What the step computed: one token per sampling row, in `ModelStep.sampling` order; logprobs per row when
    asked; the pooled hidden states of the pooling rows."""
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    errors: dict[int, str] = field(default_factory=dict)   # row -> why sampling failed for it alone
    prompt_logprobs: list[list[PromptLogprob]] = field(default_factory=list)   # per `ModelStep.prompt_logprobs` row
    # per row with a pooling span, in row order: the float32 sum of its span's final hidden states
    pooled: list[list[float]] = field(default_factory=list)
    # speculative decoding with the model's MTP head: sampling row -> the drafts to follow the token it sampled (the
    # row that ends its request's step: a decode, a prompt's last chunk, a speculating request's last accepted row)
    draft_token_ids: dict[int, tuple[int, ...]] = field(default_factory=dict)
