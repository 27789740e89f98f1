"""SpeculativeConfig: `--speculative-config '{"method": "ngram", ...}'` as vLLM spells it, parsed and checked once.

Methods that need no second model:
- `ngram` (prompt lookup): match the sequence's last n tokens (n from `prompt_lookup_max` down to
  `prompt_lookup_min`) against an earlier place in the same sequence (prompt and output) and propose the
  `num_speculative_tokens` tokens that followed it there.
- `suffix` (suffix decoding, as Arctic Inference and vLLM's `suffix`): a suffix index over the request's own
  tokens and over the outputs of recent requests (at most `suffix_decoding_max_cached_requests` of them, the
  bound on its memory); the longest match of the sequence's end (up to `suffix_decoding_max_tree_depth` tokens)
  proposes the continuation seen most often, token by token, while its frequency stays above
  `suffix_decoding_min_token_prob` and for at most `suffix_decoding_max_spec_factor` times the matched length.
- `mtp` (multi-token prediction): the model's own MTP head (Qwen3.5's `mtp.*` block) drafts
  `num_speculative_tokens` tokens right after each step, from the step's final hidden states
  (runner/mtp_drafter.py); a model without one is refused at load.

`disable_by_batch_size` (vLLM's name): no request speculates in a step while more than this many are running (a
verification costs k + 1 rows; on a CPU a decode step of many rows is compute bound and speculation stops paying).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix", "mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_spec_factor: float = 1.0      # propose at most this times the matched length

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r} "
                             "(separate draft models and EAGLE are not built)")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        for name in ("prompt_lookup_max", "prompt_lookup_min", "suffix_decoding_max_tree_depth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) is greater than "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config.disable_by_batch_size must be >= 1, got "
                             f"{self.disable_by_batch_size!r}")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("speculative_config.suffix_decoding_max_cached_requests must be >= 0, got "
                             f"{self.suffix_decoding_max_cached_requests!r}")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ValueError("speculative_config.suffix_decoding_max_spec_factor must be > 0, got "
                             f"{self.suffix_decoding_max_spec_factor!r}")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("speculative_config.suffix_decoding_min_token_prob must be in [0, 1], got "
                             f"{self.suffix_decoding_min_token_prob!r}")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A JSON object (the flag's text) or a dict (LLM(speculative_config=...)); unknown keys are an error."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]} is not a setting kvflow knows (known: "
                             f"{', '.join(sorted(known))})")
        if "method" not in value:
            raise ValueError(f"speculative_config.method is required: one of {', '.join(METHODS)}")
        return cls(**value)
