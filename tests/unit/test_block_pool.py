"""BlockPool and KVCacheManager: ref counts, LRU eviction, verified prefix hits."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.block_hash import hash_block, hash_blocks
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tuple(tokens), SamplingParams())


def test_hash_chain_depends_on_every_earlier_block():
    a = hash_blocks(list(range(48)), 16)
    b = hash_blocks([999] + list(range(1, 48)), 16)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))
    assert hash_blocks(list(range(40)), 16) == a[:2]  # partial block not hashed
    assert hash_blocks(list(range(48)), 16, a[:1]) == a  # continuing a chain


def test_allocate_release_lru_and_eviction():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, hash_block(None, [1, 2]), [1, 2])
    pool.release([b, a])  # b freed first: b is older, evicted before a
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 1
    fresh = pool.allocate(3)  # two never-used blocks, then b; a survives
    assert a not in fresh and pool.lookup(hash_block(None, [1, 2]), [1, 2]) is a
    assert pool.allocate(1) == [a] and pool.num_cached_blocks == 0 and pool.num_evictions == 1


def test_lookup_verifies_tokens_and_touch_pins():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    h = hash_block(None, [5, 6])
    pool.cache(a, h, [5, 6])
    assert pool.lookup(h, [5, 7]) is None  # a hash collision cannot serve wrong tokens
    pool.release([a])
    pool.touch([a])
    assert a.ref_count == 1 and pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="only 1 free"):
        pool.allocate(2)
    pool.release([a])
    with pytest.raises(AssertionError, match="released twice"):
        pool.release([a])


def test_prefix_hit_reuses_blocks_and_keeps_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = _request("a", list(range(12)))
    assert kv.allocate(first, 12)
    first.num_computed_tokens = 12
    kv.cache_computed_blocks(first)
    kv.forget(first)
    same = _request("b", list(range(12)))
    hits = kv.find_cached_prefix(same)
    assert len(hits) == 2  # 3 full blocks cached, the last token must be recomputed
    longer = _request("c", list(range(13)))
    assert len(kv.find_cached_prefix(longer)) == 3
    longer_hits = kv.find_cached_prefix(longer)
    assert longer_hits[:2] == hits
    assert kv.allocate(longer, 1, longer_hits)
    assert kv.block_ids("c") == [b.block_id for b in longer_hits] + kv.block_ids("c")[3:]
    assert len(kv.block_ids("c")) == 4
    kv.forget(longer)
    assert kv.num_free_blocks == 16


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    big = _request("a", list(range(20)))
    assert not kv.allocate(big, 20)
    assert kv.num_free_blocks == 4 and kv.block_ids("a") == []


def test_randomized_accounting_returns_to_total():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    live: list[Request] = []
    shared = [rng.randrange(50) for _ in range(16)]
    for i in range(400):
        if live and rng.random() < 0.4:
            kv.forget(live.pop(rng.randrange(len(live))))
            continue
        tail = [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        tokens = shared[: rng.randrange(17)] + tail
        request = _request(str(i), tokens)
        hits = kv.find_cached_prefix(request)
        if kv.allocate(request, len(tokens) - 4 * len(hits), hits):
            request.num_computed_tokens = len(tokens)
            kv.cache_computed_blocks(request)
            live.append(request)
        held = sum(len(kv.block_ids(r.request_id)) for r in live)
        assert kv.num_free_blocks >= 32 - held  # shared hits make held an over-count
    for request in live:
        kv.forget(request)
    assert kv.num_free_blocks == 32
    assert all(kv.pool.block(i).ref_count == 0 for i in range(32))
