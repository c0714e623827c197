"""WorkerStats, a worker's load: its KV tier counts read from the engine (0 without tiers, but
for its measured prefill rate), its pulled tokens, and both roles' gRPC services putting them,
and the tokens computed, into WorkerLoad."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from pdserve.decode_worker.service import DecodeServicer
from pdserve.engine.block_hash import hash_blocks
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_tiers import KVTiers, TierResults, TierStats
from pdserve.engine.step_budget import StepFit
from pdserve.engine.worker_stats import KV_TIER_FIELDS, STEP_FIELDS, WorkerStats
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.prefill_worker.service import PrefillServicer
from pdserve.proto import worker_pb2

BS = 4
BLOCK_NBYTES = 4096


def fake_core(tiers: KVTiers | None, pool: BlockPool) -> SimpleNamespace:
    """What WorkerStats.from_core reads of an EngineCore, no model behind it."""
    stats = SimpleNamespace(num_computed_tokens=1234, num_spec_verifications=0,
                            num_draft_tokens=0, num_accepted_tokens=0, tier_saved_s=2.5,
                            num_pulled_tokens=48, num_failed_pull_tokens=16)
    scheduler = SimpleNamespace(running=[], waiting=[], stats=stats,
                                step_token_budget=lambda: 512, num_prefill_tokens=lambda: 77,
                                step_time=SimpleNamespace(
                                    fit=lambda: StepFit(0.003, 0.0002, 0.0004),
                                    slope_fitted=True, decode_slope_fitted=True))
    kv_cache = SimpleNamespace(pool=pool, num_free_blocks=pool.num_free_blocks, tiers=tiers)
    config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=8),
                             cache=SimpleNamespace(block_size=BS),
                             model=SimpleNamespace(quantization=None))
    offload = None if tiers is None else SimpleNamespace(
        block_nbytes=BLOCK_NBYTES, host_load_s=0.001, disk_load_s=None)
    runner = SimpleNamespace(weight_bytes=1, loras=None, offload=offload)
    return SimpleNamespace(kv_cache=kv_cache, scheduler=scheduler, config=config,
                           tp=SimpleNamespace(size=1), runner=runner)


def tiers_holding(pool: BlockPool, num_host: int, num_disk: int) -> KVTiers:
    """Tiers whose host holds `num_host` stored blocks and whose disk holds `num_disk`."""
    tiers = KVTiers(pool, num_host_slots=8, num_disk_blocks=8)
    tokens = list(range((num_host + num_disk) * BS))
    hashes = hash_blocks(tokens, BS)
    chunks = [tuple(tokens[i * BS:(i + 1) * BS]) for i in range(len(hashes))]
    blocks = pool.allocate(num_host)
    for block, h, chunk in zip(blocks, hashes, chunks):
        assert pool.cache(block, h, chunk)
        tiers.on_cached(block)
    pool.release(blocks)
    ops = tiers.take_ops()
    tiers.apply(TierResults(stored=tuple(slot for _, slot in ops.stores)))
    tiers.adopt_disk(list(zip(hashes[num_host:], chunks[num_host:])))
    return tiers


def test_from_core_reports_the_tiers() -> None:
    pool = BlockPool(16)
    tiers = tiers_holding(pool, num_host=3, num_disk=2)
    # every count distinct (stores is 3, from the three blocks written through)
    tiers.stats = dataclasses.replace(tiers.stats, host_hits=11, disk_hits=7, demotions=5,
                                      promotions=6, failed_promotions=2, evictions=9)
    s = WorkerStats.from_core(fake_core(tiers, pool))
    assert s.kv_tier_counts() == {
        "kv_block_bytes": BLOCK_NBYTES, "num_kv_host_blocks": 3, "num_kv_disk_blocks": 2,
        "num_kv_host_hits": 11, "num_kv_disk_hits": 7, "num_kv_stores": 3,
        "num_kv_demotions": 5, "num_kv_promotions": 6, "num_kv_failed_promotions": 2,
        "num_kv_tier_evictions": 9, "kv_tier_saved_s": 2.5, "kv_host_load_s": 0.001,
        "kv_disk_load_s": 0.0}
    assert s.num_computed_tokens == 1234


def test_from_core_reports_zeros_without_tiers() -> None:
    s = WorkerStats.from_core(fake_core(None, BlockPool(16)))
    assert s.kv_tier_counts() == dict.fromkeys(KV_TIER_FIELDS, 0)
    # the steps' line and queue are measured with or without tiers
    assert s.step_counts() == {"step_token_budget": 512, "prefill_s_per_token": 0.0002,
                               "step_intercept_s": 0.003, "step_slope_fitted": True,
                               "decode_s_per_token": 0.0004, "num_prefill_tokens": 77}
    assert s.num_computed_tokens == 1234 and s.num_blocks == 16
    assert (s.num_pulled_tokens, s.num_failed_pull_tokens) == (48, 16)


NUMBERS = tuple(name for name in (*KV_TIER_FIELDS, *STEP_FIELDS) if name != "step_slope_fitted")


def _stats() -> WorkerStats:
    """A load whose every count is distinct."""
    tiers = {name: 100 + i for i, name in enumerate(NUMBERS)} | {"step_slope_fitted": True}
    return WorkerStats(num_blocks=64, num_free_blocks=60, num_cached_blocks=3, num_running=1,
                       num_waiting=0, num_reserved=0, num_computed_tokens=5000, max_num_seqs=8,
                       block_size=BS, tp_size=1, num_spec_verifications=0, num_draft_tokens=0,
                       num_accepted_tokens=0, num_pulled_tokens=90, num_failed_pull_tokens=91,
                       **tiers)


def _load_fields(load) -> dict[str, int]:
    return {name: getattr(load, name)
            for name in ("num_computed_tokens", *KV_TIER_FIELDS, *STEP_FIELDS)}


PULLED = ("num_pulled_tokens", "num_failed_pull_tokens")


def test_both_services_put_the_counts_into_their_load() -> None:
    stats = _stats()
    expected = {"num_computed_tokens": 5000, **stats.kv_tier_counts(), **stats.step_counts()}
    assert sorted(expected[name] for name in NUMBERS) == [*range(100, 100 + len(NUMBERS))]
    assert expected["step_slope_fitted"] is True
    worker = SimpleNamespace(stats=lambda: stats, is_alive=lambda: True)
    prefill = PrefillServicer(worker, "prefill-0")
    assert _load_fields(prefill.GetLoad(None, None)) == expected
    decode = DecodeServicer.__new__(DecodeServicer)  # no output fan-out thread: GetLoad only
    decode.worker, decode.worker_id = worker, "decode-0"
    worker.pusher = None  # serves no pulls
    load = decode.GetLoad(None, None)
    assert _load_fields(load) == expected
    assert [getattr(load, name) for name in PULLED] == [90, 91]
    assert not load.HasField("kv_source")
    worker.pusher = SimpleNamespace(source=Endpoint("10.0.0.7", 4321, 0))
    assert decode.GetLoad(None, None).kv_source == worker_pb2.Endpoint(
        host="10.0.0.7", port=4321, rank=0)


def test_tier_stats_fields_are_all_reported() -> None:
    # a count the tiers gain must reach the load report too (besides the TierStats counts:
    # the block bytes, the blocks each tier holds, the scheduler's saved seconds, and the
    # measured costs: host load, disk read)
    assert len(dataclasses.fields(TierStats)) + 6 == len(KV_TIER_FIELDS)
