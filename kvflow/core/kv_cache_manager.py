"""KVCacheManager: owns the KV blocks, their reference counts, the LRU free queue and the prefix cache.

A block is identified by its index in the KV tensors. A full block whose KV has been computed gets a key
chained on its parent's: (parent_hash, its token ids). Equal keys mean equal KV, so a new request can
reuse the longest run of cached blocks at the start of its prompt. Freed blocks keep their key and stay
in the free queue (least recently freed first); they are evicted only when a fresh block is needed.

A hybrid model's state slots (`state`, core/state_cache.py) are taken, restored and freed here with the blocks: a
prefix-cache hit stops at the last block with a state checkpoint.

Whether a request takes part is decided per request (`caches`): every request when the engine's prefix caching is on,
else only the requests that ask for it (`Request.cache_prefix`: beam search's one-token steps, whose beams share their
prompt's blocks). With it off, only such requests' blocks ever get a key, so a block held by any other request has
none.
"""
from __future__ import annotations

from collections import OrderedDict

from kvflow.core.state_cache import StateCache
from kvflow.request import Request

NO_PARENT = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 state: StateCache | None = None):
        self.num_blocks = num_blocks
        self.state = state
        self._found: dict[str, int] = {}      # hybrids: request id -> cached blocks its last lookup found (uncut)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_key: list[tuple | None] = [None] * num_blocks   # (parent_hash, token ids) when cached
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[tuple, int] = {}                          # key -> block id
        self.block_tables: dict[str, list[int]] = {}
        self.num_hashed_blocks: dict[str, int] = {}
        # counters (tokens) for metrics; a query counts when its request is admitted
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evictions = 0         # cached blocks overwritten to serve new ones

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free, as in vLLM); for a hybrid, of the
        bytes of blocks and live state slots held (checkpoints, like cached blocks, count as free)."""
        blocks = 1.0 - len(self.free_queue) / self.num_blocks
        if self.state is None:
            return blocks
        kv, slots = self.state.kv_bytes, self.state.counts.live * self.state.counts.slot_bytes
        return (blocks * kv + self.state.usage_bytes) / (kv + slots)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------------
    def caches(self, request: Request) -> bool:
        """Whether this request takes prefix-cache hits and gives its full blocks keys."""
        return self.enable_prefix_caching or request.cache_prefix

    def _keys(self, token_ids: list[int], num_full_blocks: int, parent: int = NO_PARENT, start: int = 0):
        bs = self.block_size
        for i in range(start, num_full_blocks):
            key = (parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            yield key
            parent = hash(key)

    @staticmethod
    def _root(request: Request) -> int:
        """The first block's parent key: the adapter's id under LoRA (its KV differs from the base model's and every
        other adapter's for the same tokens), else NO_PARENT."""
        lora = request.lora
        return NO_PARENT if lora is None else hash(("lora", lora.lora_int_id))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached blocks at the start of the request's tokens, and how many tokens
        they hold. At least one token is always left to compute, so the step has logits to sample. A lookup
        only: the counters move when the request is admitted (`record_prefix_query`)."""
        if not self.caches(request):
            return [], 0
        num_full = (request.num_tokens - 1) // self.block_size
        hits, keys = [], []
        for key in self._keys(request.token_ids, num_full, self._root(request)):
            block = self.cached.get(key)   # dict equality compares the token ids: no false hits
            if block is None:
                break
            hits.append(block)
            keys.append(key)
        if self.state is not None:
            # recurrent layers between the attention layers: usable only up to a state checkpoint
            self._found[request.request_id] = len(hits)
            while hits and self.state.checkpoint_of(keys[len(hits) - 1]) is None:
                hits.pop()
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, request: Request, num_cached: int) -> None:
        """Count an admitted request's prefix-cache query: its tokens queried, `num_cached` of them hits (from
        `get_computed_blocks`). Once per admission: a request that looked but had to wait counts nothing yet."""
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_cached

    def cache_full_blocks(self, request: Request) -> None:
        """Give keys to the request's blocks that became full of computed KV during this step."""
        if not self.caches(request):
            return
        self._cache_full_blocks(request)
        if self.state is not None:
            table = self.block_tables[request.request_id]
            self.state.register_checkpoints(request, lambda i: self.block_key[table[i]] if i < len(table) else None)

    def _cache_full_blocks(self, request: Request) -> None:
        table = self.block_tables[request.request_id]
        done = self.num_hashed_blocks.get(request.request_id, 0)
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= done:
            return
        parent = hash(self.block_key[table[done - 1]]) if done else self._root(request)
        for i, key in enumerate(self._keys(request.token_ids, num_full, parent, done), start=done):
            block = table[i]
            if key not in self.cached:   # an identical block may already be cached: keep the first
                self.cached[key] = block
                self.block_key[block] = key
            elif self.block_key[block] is None:
                self.block_key[block] = key  # same content, not in the map: still chain on it
        self.num_hashed_blocks[request.request_id] = num_full

    # ---- allocation ----------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        key = self.block_key[block]
        if key is not None:                      # evict: its content is about to be overwritten
            if self.cached.get(key) == block:
                del self.cached[key]
            self.block_key[block] = None
            self.num_evictions += 1
        self.ref_cnt[block] = 1
        return block

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens. False (and nothing changed) when blocks run out."""
        table = self.block_tables.get(request.request_id, [])
        computed_blocks = computed_blocks or []
        admits = self.state is not None and request.request_id not in self.state.live
        if admits and not self.state.can_admit():
            return False                                   # no live state slot free: it waits
        have = len(table) + len(computed_blocks)
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - have
        # cached blocks we are about to reuse that sit in the free queue are not available for new ones
        reused_free = sum(1 for b in computed_blocks if self.ref_cnt[b] == 0)
        if need > len(self.free_queue) - reused_free:
            return False
        self.block_tables[request.request_id] = table
        for b in computed_blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
            table.append(b)
        if computed_blocks:
            self.num_hashed_blocks[request.request_id] = len(computed_blocks)
        for _ in range(max(need, 0)):
            table.append(self._take_free_block())
        if admits:
            self._admit_state(request, computed_blocks)
        return True

    def _admit_state(self, request: Request, computed_blocks: list[int]) -> None:
        """A hybrid's request takes a live state slot, from its hit's checkpoint or zero; a caching one will leave
        checkpoints at its prompt's last block boundary and at the end of the cached blocks its lookup found."""
        found = self._found.pop(request.request_id, 0)
        self.state.admit(request, self.state.restore(self.block_key[computed_blocks[-1]]) if computed_blocks else None)
        if self.caches(request):
            self.state.want_checkpoints(request, {(request.num_tokens - 1) // self.block_size, found})

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first: the shared prefix stays cached the longest."""
        table = self.block_tables.pop(request.request_id, None)
        self.num_hashed_blocks.pop(request.request_id, None)
        if self.state is not None:
            self._found.pop(request.request_id, None)
            self.state.free(request)
        if not table:
            return
        for b in reversed(table):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                if self.block_key[b] is None:   # uncached (every block, prefix caching off, but beam steps')
                    self.free_queue.move_to_end(b, last=False)  # reuse it first

    def reset_prefix_cache(self) -> None:
        if self.state is not None:
            self.state.reset()
        for key, b in list(self.cached.items()):
            if self.ref_cnt[b] == 0:
                del self.cached[key]
                self.block_key[b] = None

    # ---- integrity -----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError unless the idle invariant holds: every block free, nothing referenced."""
        if self.block_tables:
            raise AssertionError(f"requests still hold blocks: {sorted(self.block_tables)}")
        bad = [b for b, c in enumerate(self.ref_cnt) if c != 0]
        if bad:
            raise AssertionError(f"blocks with references left: {bad[:10]}")
        if len(self.free_queue) != self.num_blocks:
            raise AssertionError(f"free queue holds {len(self.free_queue)} of {self.num_blocks} blocks")
        for key, b in self.cached.items():
            if self.block_key[b] != key:
                raise AssertionError(f"prefix cache map and block {b} disagree")
        if self.state is not None:
            self.state.check()
