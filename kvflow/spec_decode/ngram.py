"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's end.

For n from `prompt_lookup_max` down to `prompt_lookup_min`: the last n tokens of the sequence (prompt and output)
are searched for in the rest of it; the latest earlier occurrence that has a continuation proposes up to `k` of
the tokens after it — when those run into the sequence's end, the sequence is repeating with that period, and the
proposal goes on repeating it. One vectorised comparison per n over the sequence (numpy): ~20 us for 1,000 tokens.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` proposed tokens for `tokens` (int64, the whole sequence); [] when no n-gram recurs."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # occurrences starting at i <= length - n - 1: each has at least one token after it (the sequence's own
        # end, which starts at length - n, is not among them)
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            proposal = tokens[start:start + k]
            if len(proposal) < k:       # the match runs into the sequence's end: a loop of period length - start
                proposal = np.resize(proposal, k)
            return proposal.tolist()
    return []


class NgramProposer:
    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        return ngram_lookup(np.asarray(token_ids, dtype=np.int64), min(k, self.k), self.n_min, self.n_max)

    def finished(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Nothing to remember: prompt lookup reads only the request's own sequence."""
