"""Unit tests of the KV cache manager: allocation, freeing order, prefix-cache hits and eviction."""
import pytest

from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=4), max_tokens=4)


def test_allocate_and_free_returns_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert len(kv.block_tables["a"]) == 3 and kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)
    kv.free(r)
    kv.check()
    assert kv.usage == 0


def test_allocation_fails_without_side_effects_when_blocks_run_out():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = req("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert "a" not in kv.block_tables and kv.num_free_blocks == 2
    kv.check()


def test_prefix_hit_reuses_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", list(range(12)))
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a)
    b = req("b", list(range(12)))        # identical prompt: only 2 of 3 blocks may be reused
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8 and blocks == kv.block_tables["a"][:2]
    c = req("c", list(range(8)) + [99, 98, 97, 96, 5])
    blocks, n = kv.get_computed_blocks(c)
    assert n == 8
    d = req("d", [7] + list(range(1, 12)))  # first block differs: the chain breaks at once
    assert kv.get_computed_blocks(d) == ([], 0)
    b.num_computed_tokens = 8
    assert kv.allocate_slots(b, 4, blocks)
    assert [kv.ref_cnt[x] for x in kv.block_tables["b"][:2]] == [2, 2]
    kv.free(a)
    kv.free(b)
    kv.check()


def test_freed_blocks_stay_cached_until_evicted_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5, 6, 7])
    kv.allocate_slots(a, 7)
    a.num_computed_tokens = 7
    kv.cache_full_blocks(a)
    head, mid, tail, partial = kv.block_tables["a"]
    kv.free(a)
    kv.check()
    # after freeing, the uncached partial block is reused first, then the tail, and the head last
    assert list(kv.free_queue)[:2] == [partial, tail]
    assert list(kv.free_queue)[-1] == head
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 6 and blocks == [head, mid, tail]
    # an unrelated request needing 3 blocks evicts partial, tail and mid: only the head survives
    c = req("c", [9] * 6)
    kv.allocate_slots(c, 6)
    kv.free(c)
    assert kv.get_computed_blocks(req("d", [1, 2, 3, 4, 5, 6, 7]))[1] == 2
    kv.check()


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    kv.free(a)
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5])) == ([], 0)
    kv.check()


def test_with_prefix_caching_off_only_requests_that_ask_share_blocks():
    """Request.cache_prefix (beam search's steps) turns prefix caching on for one request: its full blocks get keys
    and it takes hits; every other request neither, and its freed blocks are reused first."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)

    def beam_step(rid, tokens):
        return Request(rid, tokens, SamplingParams(max_tokens=1), max_tokens=1, cache_prefix=True)

    a = beam_step("a", list(range(10)))
    assert kv.get_computed_blocks(a) == ([], 0)
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    shared = kv.block_tables["a"][:2]
    plain = req("p", list(range(10)) + [50])
    assert kv.get_computed_blocks(plain) == ([], 0)        # the engine's setting: no hits for it
    beams = [beam_step(f"b{i}", list(range(10)) + [60 + i]) for i in range(3)]
    for b in beams:                                          # every beam hits the prompt's two full blocks
        blocks, n = kv.get_computed_blocks(b)
        assert (blocks, n) == (shared, 8)
        b.num_computed_tokens = n
        assert kv.allocate_slots(b, 3, blocks)
    assert [kv.ref_cnt[x] for x in shared] == [4, 4]         # one copy, four holders
    kv.allocate_slots(plain, 11)
    plain.num_computed_tokens = 11
    kv.cache_full_blocks(plain)
    assert all(kv.block_key[x] is None for x in kv.block_tables["p"])
    plain_blocks = kv.block_tables["p"]
    kv.free(plain)
    assert list(kv.free_queue)[:3] == plain_blocks              # uncached: reused first
    for r in (a, *beams):
        kv.free(r)
    assert all(kv.block_key[x] is not None for x in shared)  # kept for the next step, evicted last
    assert set(list(kv.free_queue)[-2:]) == set(shared)
    kv.check()
