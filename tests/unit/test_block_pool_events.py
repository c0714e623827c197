"""BlockPool stored/evicted events: off by default, net effect per drain, snapshot of hashes."""

from __future__ import annotations

import random

from pdserve.engine.block_hash import hash_block
from pdserve.engine.block_pool import BlockPool


def _h(i: int) -> bytes:
    return hash_block(None, [i])


def _cache_new(pool: BlockPool, i: int):
    (block,) = pool.allocate(1)
    pool.cache(block, _h(i), [i])
    return block


def test_recording_is_off_by_default():
    pool = BlockPool(2)
    block = _cache_new(pool, 1)
    pool.release([block])
    pool.allocate(2)  # evicts
    assert pool._events is None and pool.drain_events() == ([], [])


def test_stored_and_evicted_in_order_and_drain_clears():
    pool = BlockPool(3, record_events=True)
    a, b = _cache_new(pool, 1), _cache_new(pool, 2)
    assert pool.drain_events() == ([_h(1), _h(2)], [])
    assert pool.drain_events() == ([], [])
    pool.release([b, a])  # freed, still cached: no event
    assert pool.drain_events() == ([], [])
    pool.allocate(2)  # the never-used block, then b: evicts hash 2 only
    assert pool.drain_events() == ([], [_h(2)])
    assert pool.cached_hashes() == [_h(1)]


def test_duplicate_cache_records_nothing():
    pool = BlockPool(2, record_events=True)
    _cache_new(pool, 1)
    (other,) = pool.allocate(1)
    pool.cache(other, _h(1), [1])  # identical block already cached: it wins
    assert pool.drain_events() == ([_h(1)], [])


def test_stored_then_evicted_nets_to_evicted_and_back():
    pool = BlockPool(1, record_events=True)
    block = _cache_new(pool, 7)
    pool.release([block])
    block = _cache_new(pool, 8)  # reuses the block: 7 evicted, 8 stored
    assert pool.drain_events() == ([_h(8)], [_h(7)])
    pool.release([block])
    block = _cache_new(pool, 7)  # 8 evicted, 7 stored
    pool.release([block])
    _cache_new(pool, 8)  # 7 evicted, 8 stored again: net 7 gone, 8 present
    assert pool.drain_events() == ([_h(8)], [_h(7)])


def test_reset_prefix_cache_evicts_everything():
    pool = BlockPool(2)
    _cache_new(pool, 1)
    pool.enable_events()  # hashes cached before enabling are not replayed
    _cache_new(pool, 2)
    pool.reset_prefix_cache()
    stored, evicted = pool.drain_events()
    assert stored == [] and set(evicted) == {_h(1), _h(2)}
    assert pool.cached_hashes() == []


def test_applying_drains_tracks_the_cache_exactly():
    """Random churn: SREM evicted then SADD stored per drain reproduces the cached set."""
    rng = random.Random(0)
    pool = BlockPool(8, record_events=True)
    mirror: set[bytes] = set()
    held: list = []
    for step in range(400):
        if held and (rng.random() < 0.5 or pool.num_free_blocks == 0):
            pool.release([held.pop(rng.randrange(len(held)))])
        else:
            (block,) = pool.allocate(1)
            held.append(block)
            token = rng.randrange(12)  # few distinct hashes: duplicates and re-stores happen
            pool.cache(block, _h(token), [token])
        if step % rng.randint(1, 7) == 0:
            stored, evicted = pool.drain_events()
            assert not set(stored) & set(evicted)
            mirror.difference_update(evicted)
            mirror.update(stored)
            assert mirror == set(pool.cached_hashes())
    assert pool.num_evictions > 50  # the churn really evicted, many times
