"""Which engine process gets a request when several serve one frontend (`--data-parallel-size N`): the one
most likely to hold the longest prefix of its prompt in its prefix cache, then the least loaded.

The frontend cannot see the engines' caches, so it keeps its own view: the chain hashes of the full KV blocks of
every prompt it sent to each engine (the key the engine's KV cache manager gives a full block: parent key and the
block's token ids), in an LRU bounded per engine. A prompt's match on an engine is how many of its leading blocks
are in that engine's view. The view can be stale (the engine evicted a block since); a stale hit costs a
recomputation, never a wrong answer. Load is the number of the engine's unfinished core requests.
"""
from __future__ import annotations

from collections import OrderedDict


class EngineRouter:
    def __init__(self, num_engines: int, block_size: int, max_blocks_per_engine: int = 100_000) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks_per_engine
        self.views: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_engines)]
        self.load = [0] * num_engines

    def block_keys(self, prompt_token_ids: list[int]) -> list[int]:
        keys, parent, b = [], None, self.block_size
        for start in range(0, len(prompt_token_ids) - b + 1, b):
            parent = hash((parent, tuple(prompt_token_ids[start:start + b])))
            keys.append(parent)
        return keys

    def choose(self, prompt_token_ids: list[int]) -> int:
        """The engine for this prompt; its blocks are added to that engine's view."""
        if len(self.views) == 1:
            return 0
        keys = self.block_keys(prompt_token_ids)

        def matched(view) -> int:
            n = 0
            for key in keys:
                if key not in view:
                    break
                n += 1
            return n

        best = max(range(len(self.views)), key=lambda i: (matched(self.views[i]), -self.load[i], -i))
        view = self.views[best]
        for key in keys:
            view[key] = None
            view.move_to_end(key)
        while len(view) > self.max_blocks:
            view.popitem(last=False)
        return best
