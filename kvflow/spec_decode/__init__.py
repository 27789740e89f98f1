"""Speculative decoding's proposers (no second model): each proposes up to k tokens from the request's own
sequence (and, for suffix decoding, recent outputs), or hands out the drafts the model's own MTP head made after the
request's last step (`mtp`); the scheduler verifies them in the next step (core/scheduler.py, docs/architecture.md
"Speculative decoding")."""
from __future__ import annotations

from typing import Protocol

from kvflow.speculative_config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `token_ids` (prompt + output so far); [] for none."""

    def finished(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        """The request is done (its tokens may teach later proposals)."""


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "mtp":          # the model's own head drafts, in the runner: this keeps its drafts
        from kvflow.spec_decode.mtp import MtpProposer
        return MtpProposer(config.num_speculative_tokens)
    if config.method == "ngram":
        from kvflow.spec_decode.ngram import NgramProposer
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    from kvflow.spec_decode.suffix import SuffixProposer
    return SuffixProposer(config.num_speculative_tokens, config.suffix_decoding_max_tree_depth,
                          config.suffix_decoding_max_cached_requests, config.suffix_decoding_min_token_prob,
                          config.suffix_decoding_max_spec_factor)
