"""Beam search as vLLM runs it: in the frontend, on the engine's own requests. One concept: the beams of one prompt,
how they grow and how they are scored. `LLM.beam_search` and the server (`AsyncEngine.beam_search`) both drive it.

Each step, every live beam becomes a one-token request (its prompt: the prompt and the beam's tokens so far;
`max_tokens=1`, `logprobs=2 * beam_width`), all of a step's beams submitted together so they share the continuous
batch. The requests take the prefix cache whatever the engine's setting (`cache_prefix`, core/kv_cache_manager.py):
a beam's full blocks were computed by its parent's request one step earlier, so each request computes only its last
partial block, and the beams of a width-k search hold one copy of the prompt's blocks, not k.

What vLLM does (vllm/beam_search.py and `LLM.beam_search` in vllm/entrypoints/llm.py; the server's async
`beam_search` in vllm/entrypoints/openai/serving_engine.py, now engine/serving.py), and so this module:
- every entry of a beam's step logprobs (the 2k most likely tokens, and the sampled one when it is not among them:
  with `temperature` > 0 that is a random extra candidate, as in vLLM) extends it by one token; a candidate ending
  in EOS (unless `ignore_eos`) is complete, the others are ranked by score and the best `beam_width` live on;
- the search runs `max_tokens` steps or until no beam is live: no early stopping (vLLM dropped `early_stopping`);
- the result: the completed and the live beams together, ranked by score, the best `beam_width`;
- score = cumulative logprob / len ** length_penalty, where len counts the prompt's tokens and the beam's, less
  one when the last token is EOS (vLLM's `get_beam_search_score`, adapted from transformers' older definition;
  transformers now counts the generated tokens only, EOS included: the two agree on ranking among equal-length
  beams, and on scores at length_penalty 0).
kvflow's EOS ids are the tokenizer's and the model's (`Tokenizer.eos_token_ids`, what every request stops on); vLLM
reads the tokenizer's `eos_token_id` alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Collection

from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import MAX_LOGPROBS, MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2      # each step asks for 2 * beam_width logprobs per beam


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams. `max_tokens` None: up to the model's context (the server's chat default)."""
    beam_width: int
    max_tokens: int | None = 16
    ignore_eos: bool = False
    temperature: float = 0.0          # > 0: each beam's sampled token joins its candidates (vLLM's behaviour)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False    # the EOS token in the output's token ids
    skip_special_tokens: bool = True            # in the text

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the field for any value beam search cannot run."""
        w = self.beam_width
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_BEAM_WIDTH:
            raise InvalidRequestError(
                f"the beam width (beam_width; n on the server) must be an integer in [1, {MAX_BEAM_WIDTH}] (each "
                f"step asks for 2 * beam_width log-probabilities per beam, at most {MAX_LOGPROBS}), got {w!r}",
                param="beam_width", code="invalid_value")
        m = self.max_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {m!r}", param="max_tokens",
                                      code="invalid_value")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                or not 0 <= t <= MAX_TEMPERATURE or 0 < t < MIN_TEMPERATURE:
            raise InvalidRequestError(f"temperature must be 0 or a finite number in [{MIN_TEMPERATURE}, "
                                      f"{MAX_TEMPERATURE}], got {t!r}", param="temperature", code="invalid_value")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise InvalidRequestError(f"length_penalty must be a finite number, got {lp!r}",
                                      param="length_penalty", code="invalid_value")

    def step_params(self) -> SamplingParams:
        """The sampling parameters of each beam's one-token request."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width, temperature=self.temperature)


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's): `tokens` holds the prompt's and the beam's, `logprobs` one dict per generated token (that
    step's top log-probabilities of the beam's request), `cum_logprob` the sum of its tokens' log-probabilities."""
    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None                    # LLM.beam_search: the prompt's and the beam's text (vLLM's)
    finish_reason: str | None = None           # "stop" (EOS) or "length"
    stop_reason: int | None = None             # the EOS token id that completed it (vLLM's server)


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (at most beam_width)."""
    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_ids: Collection[int],
                      length_penalty: float = 1.0) -> float:
    """vLLM's get_beam_search_score: cum_logprob / len ** length_penalty, len counting the prompt, less one for a
    final EOS."""
    return _score(len(tokens), tokens[-1], cum_logprob, eos_token_ids, length_penalty)


def _score(num_tokens: int, last_token: int, cum_logprob: float, eos_token_ids: Collection[int],
           length_penalty: float) -> float:
    seq_len = num_tokens - 1 if last_token in eos_token_ids else num_tokens
    return cum_logprob / (seq_len ** length_penalty)


class BeamSearch:
    """The beams of one prompt. Each step: `step_prompts()` are the token ids of the requests to run (one per live
    beam); `advance()` takes each one's step logprobs, in the same order. `done` once `max_tokens` steps ran or no
    beam is live; then `output()`."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, max_tokens: int,
                 eos_token_ids: Collection[int]):
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens             # resolved against the context (RequestValidator.admit)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.num_steps = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def done(self) -> bool:
        return not self.beams or self.num_steps >= self.max_tokens

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, self.eos_token_ids, self.params.length_penalty)

    def step_prompts(self) -> list[list[int]]:
        return [beam.tokens for beam in self.beams]

    def advance(self, step_logprobs: list[dict[int, float] | None]) -> None:
        """One step: `step_logprobs[i]` is live beam i's request's logprobs of its one token (token id -> logprob),
        None when that request ended without one (the beam is dropped, as vLLM drops it)."""
        if len(step_logprobs) != len(self.beams):
            raise ValueError(f"{len(step_logprobs)} step results for {len(self.beams)} beams")
        live = []          # (score, beam, token, its step's logprobs, cum_logprob): only the kept become beams
        stops = not self.params.ignore_eos
        eos, length_penalty = self.eos_token_ids, self.params.length_penalty
        for beam, logprobs in zip(self.beams, step_logprobs):
            if logprobs is None:
                continue
            num_tokens = len(beam.tokens) + 1
            for token, logprob in logprobs.items():
                cum = beam.cum_logprob + logprob
                if stops and token in eos:
                    self.completed.append(BeamSearchSequence(beam.tokens + [token], beam.logprobs + [logprobs], cum,
                                                             finish_reason="stop", stop_reason=token))
                else:
                    live.append((_score(num_tokens, token, cum, eos, length_penalty), beam, token, logprobs, cum))
        live.sort(key=lambda c: c[0], reverse=True)     # stable: ties keep beam order, then logprob order
        self.beams = [BeamSearchSequence(beam.tokens + [token], beam.logprobs + [logprobs], cum)
                      for _, beam, token, logprobs, cum in live[:self.params.beam_width]]
        self.num_steps += 1

    def output(self, decode: Callable[[list[int], bool], str] | None = None) -> BeamSearchOutput:
        """The best beam_width of the completed and live beams, best first; `decode(ids, skip_special_tokens)`
        writes each one's text (the prompt's and the beam's, as vLLM's LLM.beam_search)."""
        for beam in self.beams:
            beam.finish_reason = "length"
        best = sorted(self.completed + self.beams, key=self.score, reverse=True)[:self.params.beam_width]
        if decode is not None:
            for beam in best:
                beam.text = decode(beam.tokens, self.params.skip_special_tokens)
        return BeamSearchOutput(best)

    def completion(self, beam: BeamSearchSequence) -> tuple[list[int], list[int]]:
        """A beam as the server answers it (vLLM's): (its token ids, EOS included only with
        include_stop_str_in_output; the ids of its text, never EOS)."""
        generated = beam.tokens[self.num_prompt_tokens:]
        if beam.finish_reason != "stop":
            return generated, generated
        return (generated if self.params.include_stop_str_in_output else generated[:-1]), generated[:-1]
