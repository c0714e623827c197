"""KVTiers, the scheduler's side of the host and disk tiers: what it decides to copy, when
an entry becomes a hit, and that it holds device blocks exactly while their copy runs."""

from __future__ import annotations

import random

from pdserve.engine.block_hash import hash_blocks
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_tiers import KVTiers, TierHit, TierOps, TierResults

BS = 4


def chain(seed: int, num_blocks: int) -> tuple[list[bytes], list[tuple[int, ...]]]:
    tokens = random.Random(seed).choices(range(1000), k=num_blocks * BS)
    chunks = [tuple(tokens[i * BS:(i + 1) * BS]) for i in range(num_blocks)]
    return hash_blocks(tokens, BS), chunks


def cache(pool: BlockPool, tiers: KVTiers, hashes, chunks) -> list[int]:
    """Publish a request's blocks on the device, as KVCacheManager does; returns their ids."""
    blocks = pool.allocate(len(hashes))
    for block, h, tokens in zip(blocks, hashes, chunks):
        assert pool.cache(block, h, tokens)
        tiers.on_cached(block)
    pool.release(reversed(blocks))
    return [b.block_id for b in blocks]


def run(ops: TierOps, failed: set[bytes] = frozenset()) -> TierResults:
    """What a runner reports once every copy of `ops` is done; `failed`: unreadable files."""
    return TierResults(
        stored=tuple(slot for _, slot in ops.stores),
        demoted=tuple(h for _, h, _ in ops.demotions),
        promoted=tuple(h for h, _, _ in ops.promotions if h not in failed),
        failed_promotions=tuple(h for h, _, _ in ops.promotions if h in failed))


def test_write_through_holds_the_device_block_until_its_copy_lands():
    pool = BlockPool(8)
    tiers = KVTiers(pool, num_host_slots=4)
    hashes, chunks = chain(0, 2)
    ids = cache(pool, tiers, hashes, chunks)
    assert pool.num_free_blocks == 6  # held for the copy, though no request holds them
    assert tiers.match(hashes, chunks).host_slots == ()  # not a hit before it lands
    ops = tiers.take_ops()
    assert [b for b, _ in ops.stores] == ids
    assert tiers.busy
    tiers.apply(run(ops))
    assert pool.num_free_blocks == 8 and not tiers.busy
    assert tiers.match(hashes, chunks).host_slots == tuple(s for _, s in ops.stores)
    assert tiers.stats.stores == 2


def test_a_block_already_in_host_is_not_copied_again():
    pool = BlockPool(8)
    tiers = KVTiers(pool, num_host_slots=4)
    hashes, chunks = chain(0, 2)
    cache(pool, tiers, hashes, chunks)
    tiers.apply(run(tiers.take_ops()))
    pool.reset_prefix_cache()
    cache(pool, tiers, hashes, chunks)
    assert not tiers.take_ops() and pool.num_free_blocks == 8


def test_host_hits_stop_at_the_first_miss_and_check_tokens():
    pool = BlockPool(8)
    tiers = KVTiers(pool, num_host_slots=8)
    hashes, chunks = chain(1, 3)
    cache(pool, tiers, hashes, chunks)
    tiers.apply(run(tiers.take_ops()))
    assert len(tiers.match(hashes, chunks).host_slots) == 3
    other, other_chunks = chain(2, 3)
    assert len(tiers.match(hashes[:2] + other[2:], chunks[:2] + other_chunks[2:]).host_slots) == 2
    wrong = [chunks[0], (9, 9, 9, 9), chunks[2]]  # same hash, other tokens: never a hit
    assert len(tiers.match(hashes, wrong).host_slots) == 1


def test_load_queues_copies_into_the_given_device_blocks():
    pool = BlockPool(8)
    tiers = KVTiers(pool, num_host_slots=8)
    hashes, chunks = chain(1, 2)
    cache(pool, tiers, hashes, chunks)
    tiers.apply(run(tiers.take_ops()))
    hit = tiers.match(hashes, chunks)
    tiers.load(hit.host_slots, [6, 7])
    assert tiers.take_ops().loads == tuple(zip(hit.host_slots, [6, 7]))
    assert tiers.stats.host_hits == 2


def test_host_eviction_demotes_to_disk_and_a_disk_hit_waits_for_its_promotion():
    pool = BlockPool(16)
    tiers = KVTiers(pool, num_host_slots=2, num_disk_blocks=8)
    hashes, chunks = chain(3, 2)
    cache(pool, tiers, hashes, chunks)
    tiers.apply(run(tiers.take_ops()))
    later, later_chunks = chain(4, 2)
    cache(pool, tiers, later, later_chunks)  # takes both slots: the first chain goes to disk
    ops = tiers.take_ops()
    assert {h for _, h, _ in ops.demotions} == set(hashes)
    assert [s for s, _, _ in ops.demotions] == [s for _, s in ops.stores]  # slot freed, reused
    hit = tiers.match(hashes, chunks)
    assert hit.host_slots == () and not hit.promoting  # not on disk until the write lands
    tiers.apply(run(ops))
    hit = tiers.match(hashes, chunks)
    assert hit.promoting and hit.host_slots == ()
    promote = tiers.take_ops()
    assert [h for h, _, _ in promote.promotions] == hashes
    assert tiers.match(hashes, chunks).promoting  # still on its way: the request waits
    tiers.apply(run(promote))
    assert len(tiers.match(hashes, chunks).host_slots) == 2
    assert tiers.stats.disk_hits == 2 and tiers.stats.promotions == 2


def test_a_failed_promotion_is_a_miss_and_forgets_the_file():
    pool = BlockPool(16)
    tiers = KVTiers(pool, num_host_slots=2, num_disk_blocks=8)
    hashes, chunks = chain(3, 2)
    cache(pool, tiers, hashes, chunks)
    tiers.apply(run(tiers.take_ops()))
    cache(pool, tiers, *chain(4, 2))
    tiers.apply(run(tiers.take_ops()))
    assert tiers.match(hashes, chunks).promoting
    tiers.apply(run(tiers.take_ops(), failed={hashes[1]}))
    hit = tiers.match(hashes, chunks)
    assert len(hit.host_slots) == 1 and not hit.promoting  # block 1 is recomputed
    assert tiers.stats.failed_promotions == 1 and tiers.num_disk_blocks_held == 3


def test_a_chain_longer_than_the_host_tier_loads_what_fits_and_never_thrashes():
    pool = BlockPool(32)
    tiers = KVTiers(pool, num_host_slots=3, num_disk_blocks=16)
    hashes, chunks = chain(5, 5)
    for i in range(5):  # one block a step: the first two are demoted on the way
        cache(pool, tiers, hashes[i:i + 1], chunks[i:i + 1])
        tiers.apply(run(tiers.take_ops()))
    cache(pool, tiers, *chain(6, 3))  # the rest of the chain goes to disk
    tiers.apply(run(tiers.take_ops()))
    assert tiers.num_disk_blocks_held == 5
    for _ in range(4):  # each round promotes, never evicting the chain's own blocks
        hit = tiers.match(hashes, chunks)
        if not hit.promoting:
            break
        tiers.apply(run(tiers.take_ops()))
    assert not hit.promoting and len(hit.host_slots) == 3


def test_capacities_hold_and_a_full_disk_drops_its_oldest_file():
    pool = BlockPool(64)
    tiers = KVTiers(pool, num_host_slots=2, num_disk_blocks=3)
    deleted: list[bytes] = []
    for seed in range(6):
        cache(pool, tiers, *chain(10 + seed, 2))
        ops = tiers.take_ops()
        deleted += ops.deletes
        tiers.apply(run(ops))
        assert tiers.num_host_blocks <= 2 and tiers.num_disk_blocks_held <= 3
    assert len(deleted) == 12 - 2 - 3  # every block went through; host and disk keep 5
    assert tiers.stats.evictions == len(deleted)
    assert pool.num_free_blocks == 64


def test_every_slot_mid_copy_means_no_store_and_nothing_held():
    pool = BlockPool(8)
    tiers = KVTiers(pool, num_host_slots=1)
    cache(pool, tiers, *chain(7, 3))  # one slot, its copy not landed: the others are skipped
    ops = tiers.take_ops()
    assert len(ops.stores) == 1 and pool.num_free_blocks == 7
    tiers.apply(run(ops))
    assert pool.num_free_blocks == 8


def test_adopted_disk_blocks_are_hits_within_capacity():
    pool = BlockPool(8)
    tiers = KVTiers(pool, num_host_slots=4, num_disk_blocks=2)
    hashes, chunks = chain(8, 3)
    tiers.adopt_disk(list(zip(hashes, chunks)))  # oldest first: the newest two are kept
    assert tiers.num_disk_blocks_held == 2
    assert tiers.take_ops().deletes == (hashes[0],)  # the file over capacity goes
    assert not tiers.match(hashes, chunks).promoting  # its first block is gone
    assert tiers.match(hashes[1:], chunks[1:]).promoting


def test_a_failed_store_lets_go_of_its_device_block_and_is_no_hit():
    pool = BlockPool(8)
    tiers = KVTiers(pool, num_host_slots=4)
    hashes, chunks = chain(9, 2)
    cache(pool, tiers, hashes, chunks)
    ops = tiers.take_ops()
    tiers.apply(TierResults(stored=(ops.stores[0][1],), failed_stores=(ops.stores[1][1],)))
    assert pool.num_free_blocks == 8 and not tiers.busy
    assert len(tiers.match(hashes, chunks).host_slots) == 1 and tiers.num_host_blocks == 1


def test_loads_into_blocks_freed_before_the_step_are_dropped():
    pool = BlockPool(8)
    tiers = KVTiers(pool, num_host_slots=4)
    hashes, chunks = chain(1, 2)
    cache(pool, tiers, hashes, chunks)
    tiers.apply(run(tiers.take_ops()))
    slots = tiers.match(hashes, chunks).host_slots
    tiers.load(slots, [5, 6])
    tiers.cancel_loads([6, 7])
    assert tiers.take_ops().loads == ((slots[0], 5),)


def test_a_caller_that_will_not_wait_starts_no_disk_read():
    pool = BlockPool(16)
    tiers = KVTiers(pool, num_host_slots=2, num_disk_blocks=8)
    hashes, chunks = chain(3, 2)
    cache(pool, tiers, hashes, chunks)
    tiers.apply(run(tiers.take_ops()))
    cache(pool, tiers, *chain(4, 2))  # the first chain goes to disk
    tiers.apply(run(tiers.take_ops()))
    assert tiers.match(hashes, chunks, promote=False) == TierHit()
    assert not tiers.take_ops().promotions and tiers.stats.disk_hits == 0
