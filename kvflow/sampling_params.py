"""SamplingParams: how one request picks its tokens, with vLLM's names and defaults, and the one place that
checks every field's value. The limits below are what the engine's types can hold (int64 seeds, int32 top-k)
or what a sane request needs; the server publishes them in its OpenAPI document.

Frozen once checked: the constructor normalizes and checks every field, and nothing changes them after that. A
change is a new SamplingParams (`dataclasses.replace`, which checks it again); the frontend's own resolutions
return one (`with_bad_words_resolved`, the server's and LLM's compiled grammar), and n > 1's children are copies
of checked params made without checking again (`child`)."""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.errors import InvalidRequestError

if TYPE_CHECKING:   # llguidance is imported only where grammars are compiled or applied
    from kvflow.structured_output import CompiledGrammar
    from kvflow.structured_output.thinking import ThinkingSpec

MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1      # torch.Generator takes a signed/unsigned 64-bit seed
MAX_TOP_K = 2**31 - 1                          # larger means "all of the vocabulary" anyway
MIN_TEMPERATURE = 0.01                         # below this (but > 0) logits / t overflows to inf
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0                              # presence / frequency, as OpenAI
MAX_REPETITION_PENALTY = 100.0
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0                         # as OpenAI: -100 bans a token, +100 forces it
MAX_BAD_WORDS = 1024


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16       # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit
    logprobs: int | None = None       # number of top log-probabilities per sampled token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None   # top log-probabilities per prompt token (the first one has none)
    # words the output may not contain: a word's last token is banned wherever the output so far ends with its
    # other tokens (each word with and without a leading space, as vLLM). The frontend tokenizes them into
    # `bad_words_token_ids` (`with_bad_words_resolved`); the engine reads only the ids
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    allowed_token_ids: list[int] | None = None   # the only tokens that may be sampled
    # keep only the prompt's last k tokens (-1: the last max_model_len); applied by the frontend's validator
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"                # which end truncate_prompt_tokens cuts: "left" keeps the last k
    # vLLM's structured outputs: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} |
    # {"json_object": True}; the offline LLM compiles it into `structured`
    structured_outputs: dict | None = None
    # the compiled constraint. Set by the frontend (LLM, the server) before the engine sees the request, so a
    # compile never runs on the step loop; n > 1 children share it, each gets its own matcher in the core.
    structured: CompiledGrammar | None = field(default=None, compare=False, repr=False)
    # vLLM's: at most this many reasoning tokens; then the end-of-thinking marker is forced and the answer follows.
    # Needs `thinking` (the server's --reasoning-parser sets it)
    thinking_token_budget: int | None = None
    # where the reasoning ends, for the engine: set by the server under --reasoning-parser when a grammar must start
    # after the reasoning or a budget end it (structured_output/thinking.py); None: the engine does not track it
    thinking: ThinkingSpec | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # the constructor's own normalization, before the check; frozen from here on
        normalize = object.__setattr__
        normalize(self, "stop", [self.stop] if isinstance(self.stop, str) else list(self.stop or []))
        normalize(self, "stop_token_ids", list(self.stop_token_ids or []))
        normalize(self, "logit_bias", dict(self.logit_bias or {}))
        if self.bad_words is not None and not isinstance(self.bad_words, str):
            normalize(self, "bad_words", list(self.bad_words))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, str):
            normalize(self, "allowed_token_ids", list(self.allowed_token_ids))
        if self.top_k == -1:
            normalize(self, "top_k", 0)
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the field for any value the engine cannot run."""
        def bad(name: str, why: str, value=None) -> None:
            raise InvalidRequestError(f"{name} {why}, got {value if value is not None else getattr(self, name)!r}",
                                      param=name, code="invalid_value")

        def integer(name: str, lo: int, hi: int | None = None, *, optional: bool = False) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                bad(name, f"must be an integer in [{lo}, {hi}]" if hi is not None else f"must be an integer >= {lo}")

        def number(name: str, lo: float, hi: float) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
                bad(name, f"must be a finite number in [{lo}, {hi}]")

        integer("n", 1)
        number("temperature", 0.0, MAX_TEMPERATURE)
        if 0 < self.temperature < MIN_TEMPERATURE:
            bad("temperature", f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        number("top_p", 0.0, 1.0)
        if self.top_p == 0:
            bad("top_p", "must be in (0, 1]")
        integer("top_k", 0, MAX_TOP_K)
        number("min_p", 0.0, 1.0)
        integer("seed", MIN_SEED, MAX_SEED, optional=True)
        integer("max_tokens", 1, optional=True)
        integer("min_tokens", 0)
        integer("thinking_token_budget", 0, optional=True)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        number("presence_penalty", -MAX_PENALTY, MAX_PENALTY)
        number("frequency_penalty", -MAX_PENALTY, MAX_PENALTY)
        number("repetition_penalty", 0.0, MAX_REPETITION_PENALTY)
        if self.repetition_penalty == 0:
            bad("repetition_penalty", "must be > 0")
        integer("logprobs", 0, MAX_LOGPROBS, optional=True)
        integer("prompt_logprobs", 0, MAX_LOGPROBS, optional=True)
        if self.truncate_prompt_tokens != -1:
            integer("truncate_prompt_tokens", 1, optional=True)
        if self.truncation_side not in ("left", "right"):
            bad("truncation_side", 'must be "left" or "right"', self.truncation_side)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS:
                bad("bad_words", f"must be a list of at most {MAX_BAD_WORDS} strings")
            if any(not isinstance(w, str) or not w.strip() or len(w) > MAX_STOP_STRING_CHARS for w in self.bad_words):
                bad("bad_words", f"must be non-blank strings of at most {MAX_STOP_STRING_CHARS} characters")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids:
                bad("allowed_token_ids", "must be a non-empty list of token ids")
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                bad("allowed_token_ids", "must be non-negative integers")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings", len(self.stop))
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            bad("stop", f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids", len(self.stop_token_ids))
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries", len(self.logit_bias))
        for t, b in self.logit_bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                bad("logit_bias", "keys must be token ids (non-negative integers)", t)
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                bad("logit_bias", f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", b)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, dict):
            bad("structured_outputs", "must be a dict such as {'json': schema} or {'regex': pattern}")

    def check_vocabulary(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"{name}: token id {bad} is out of range [0, {vocab_size})",
                                          param=name, code="invalid_value")

    def with_bad_words_resolved(self, encode) -> SamplingParams:
        """These params with `bad_words` tokenized into `bad_words_token_ids` by `encode(text, add_special_tokens)`
        (the frontend's tokenizer), as vLLM does: each word as written without leading spaces, and with one leading
        space when that makes a different first token of the same length (the word in the middle of a text). The
        params themselves when there is nothing to resolve."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return self
        resolved: list[list[int]] = []
        for word in self.bad_words:
            bare = list(encode(word.lstrip(), False))
            spaced = list(encode(" " + word.lstrip(), False))
            resolved += [ids for ids in (bare, spaced if spaced[:1] != bare[:1] and len(spaced) == len(bare) else [])
                         if ids]
        return dataclasses.replace(self, bad_words_token_ids=resolved)

    def truncated(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as `truncate_prompt_tokens` leaves it: its last k tokens (-1: the last max_model_len), or its
        first k with `truncation_side` "right"."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        k = max_model_len if k == -1 else k
        if len(prompt_token_ids) <= k:
            return prompt_token_ids
        return prompt_token_ids[:k] if self.truncation_side == "right" else prompt_token_ids[-k:]

    def child(self, index: int) -> SamplingParams:
        """The index-th of n samples as its own n = 1 request: seeded `child_seed(index)`, and only the first one
        computes the prompt's logprobs (the others may then take the prompt from the prefix cache). A copy of these
        checked params with those fields set, not checked again (the same stop lists, bias, grammar)."""
        child = copy.copy(self)
        for name, value in (("n", 1), ("seed", self.child_seed(index)),
                            ("prompt_logprobs", self.prompt_logprobs if index == 0 else None)):
            object.__setattr__(child, name, value)
        return child

    def child_seed(self, index: int) -> int | None:
        """The seed of the index-th of n samples (seed + index, wrapped into the int64 range)."""
        if self.seed is None:
            return None
        return (self.seed + index - MIN_SEED) % 2**64 + MIN_SEED

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
