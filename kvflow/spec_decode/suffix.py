"""Suffix decoding (Arctic Inference's method, vLLM's `suffix`): propose the continuation most often seen after the
longest match of the sequence's end, in the request's own tokens and in the outputs of recent requests.

Arctic keeps a suffix tree; kvflow keeps the same information as positions. Recent outputs (at most
`max_cached_requests` of them: the bound on memory, ~100 bytes per cached token) are indexed by their bigrams.
A proposal takes the occurrences of the sequence's last two tokens — in its own sequence (one numpy comparison)
and in the index, the latest `MAX_CANDIDATES` of each — extends each match backwards up to `max_depth` tokens,
keeps the longest (the deepest node of the tree), then walks forward: at each position the most frequent next
token among the surviving occurrences is proposed while the product of those frequencies (the path's probability
in the tree) stays >= `min_token_prob`, for at most `k` and `spec_factor` x the match length tokens.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MAX_CANDIDATES = 32     # occurrences looked at per source: the latest ones


class SuffixProposer:
    def __init__(self, k: int, max_depth: int, max_cached_requests: int, min_token_prob: float,
                 spec_factor: float) -> None:
        self.k, self.max_depth, self.max_cached = k, max_depth, max_cached_requests
        self.min_token_prob, self.spec_factor = min_token_prob, spec_factor
        self._outputs: OrderedDict[int, np.ndarray] = OrderedDict()   # serial -> a finished request's output
        self._index: dict[tuple[int, int], list[tuple[int, int]]] = {}  # bigram -> [(serial, position after it)]
        self._serial = 0

    # ---- the cache of recent outputs -----------------------------------------------------------------------
    def finished(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Remember a finished request's output (the oldest one is forgotten beyond `max_cached_requests`)."""
        out = np.asarray(token_ids[num_prompt_tokens:], dtype=np.int64)
        if self.max_cached == 0 or len(out) < 3:
            return
        self._serial += 1
        self._outputs[self._serial] = out
        for i, key in enumerate(zip(out[:-2].tolist(), out[1:-1].tolist())):
            self._index.setdefault(key, []).append((self._serial, i + 2))
        while len(self._outputs) > self.max_cached:
            serial, old = self._outputs.popitem(last=False)
            for key in set(zip(old[:-2].tolist(), old[1:-1].tolist())):
                kept = [e for e in self._index[key] if e[0] != serial]
                if kept:
                    self._index[key] = kept
                else:
                    del self._index[key]

    @property
    def num_cached_tokens(self) -> int:
        return sum(len(o) for o in self._outputs.values())

    # ---- proposals --------------------------------------------------------------------------------------------
    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        seq = np.asarray(token_ids, dtype=np.int64)
        length = len(seq)
        if length < 3:
            return []
        key = (int(seq[-2]), int(seq[-1]))
        # (array, position after the matched bigram); own occurrences end before the sequence's last token
        hits = np.flatnonzero((sliding_window_view(seq[:length - 1], 2) == seq[length - 2:]).all(axis=1))
        candidates = [(seq, int(h) + 2) for h in hits[-MAX_CANDIDATES:]]
        candidates += [(self._outputs[s], p) for s, p in self._index.get(key, ())[-MAX_CANDIDATES:]]
        if not candidates:
            return []
        depth = [self._match_length(seq, arr, after) for arr, after in candidates]
        best = max(depth)
        active = [c for c, d in zip(candidates, depth) if d == best]
        limit = min(k, self.k, max(1, int(self.spec_factor * best)))
        proposal: list[int] = []
        prob = 1.0
        for step in range(limit):
            nexts = Counter(int(arr[after + step]) for arr, after in active if after + step < len(arr))
            if not nexts:
                break
            token, count = nexts.most_common(1)[0]
            prob *= count / sum(nexts.values())
            if prob < self.min_token_prob:
                break
            proposal.append(token)
            active = [(arr, after) for arr, after in active if after + step < len(arr) and arr[after + step] == token]
        return proposal

    def _match_length(self, seq: np.ndarray, arr: np.ndarray, after: int) -> int:
        """How many tokens before `after` in `arr` equal the end of `seq` (>= 2: the bigram), up to max_depth."""
        m, limit = 2, min(self.max_depth, after, len(seq))
        while m < limit and arr[after - 1 - m] == seq[len(seq) - 1 - m]:
            m += 1
        return m
