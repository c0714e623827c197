"""The workers' KV tier counts, computed and pulled tokens as the router exports them: one
series per worker (and tier), set from its load reports, gone when it leaves, and never summed
over router processes; and the router's own prefix pull counts."""

from __future__ import annotations

import pytest

from pdserve.proto import worker_pb2
from pdserve.router.metrics import RouterMetrics
from pdserve.router.metrics_merge import merge_expositions, totals_only
from pdserve.router.metrics_text import sample_value

HITS = "pdserve_kv_tier_hits_total"
HIT_BYTES = "pdserve_kv_tier_hit_bytes_total"
BLOCKS = "pdserve_kv_tier_blocks"
COMPUTED = "pdserve_worker_computed_tokens_total"
# name -> the load field it copies (label worker only)
PER_WORKER = {
    "pdserve_kv_tier_stores_total": "num_kv_stores",
    "pdserve_kv_tier_demotions_total": "num_kv_demotions",
    "pdserve_kv_tier_promotions_total": "num_kv_promotions",
    "pdserve_kv_tier_failed_promotions_total": "num_kv_failed_promotions",
    "pdserve_kv_tier_evictions_total": "num_kv_tier_evictions",
    COMPUTED: "num_computed_tokens",
    "pdserve_kv_tier_saved_seconds_total": "kv_tier_saved_s",
    "pdserve_worker_pulled_tokens_total": "num_pulled_tokens",
    "pdserve_worker_failed_pull_tokens_total": "num_failed_pull_tokens",
}


def tiered_load(scale: int = 1, block_bytes: int = 1000) -> worker_pb2.WorkerLoad:
    """A load report of a worker with tiers, every count distinct."""
    return worker_pb2.WorkerLoad(
        kv_block_bytes=block_bytes, num_computed_tokens=5000 * scale,
        num_kv_host_blocks=30 * scale, num_kv_disk_blocks=40 * scale,
        num_kv_host_hits=11 * scale, num_kv_disk_hits=7 * scale, num_kv_stores=13 * scale,
        num_kv_demotions=5 * scale, num_kv_promotions=6 * scale,
        num_kv_failed_promotions=2 * scale, num_kv_tier_evictions=9 * scale,
        kv_tier_saved_s=1.5 * scale, num_pulled_tokens=17 * scale,
        num_failed_pull_tokens=3 * scale)


def test_router_exports_each_workers_tier_counts() -> None:
    m = RouterMetrics()
    m.kv_tiers.set("prefill-0", tiered_load())
    m.kv_tiers.set("prefill-0", tiered_load(scale=2))  # the next load report: the latest
    text = m.render().decode()
    assert f'{HITS}{{tier="host",worker="prefill-0"}} 22.0' in text.splitlines()
    assert "# TYPE pdserve_kv_tier_hits_total counter" in text
    assert "# TYPE pdserve_kv_tier_blocks gauge" in text
    worker = {"worker": "prefill-0"}
    assert [sample_value(text, HITS, {**worker, "tier": t}) for t in ("host", "disk")] == [
        22, 14]
    assert [sample_value(text, HIT_BYTES, {**worker, "tier": t}) for t in ("host", "disk")] == [
        22_000, 14_000]
    assert [sample_value(text, BLOCKS, {**worker, "tier": t}) for t in ("host", "disk")] == [
        60, 80]
    load = tiered_load(scale=2)
    for name, field in PER_WORKER.items():
        assert sample_value(text, name, worker) == getattr(load, field), name


def test_a_worker_without_tiers_exports_only_its_computed_and_pulled_tokens() -> None:
    m = RouterMetrics()
    m.kv_tiers.set("decode-0", worker_pb2.WorkerLoad(num_computed_tokens=77,
                                                     num_pulled_tokens=64))
    m.kv_tiers.set("prefill-0", tiered_load())
    text = m.render().decode()
    assert sample_value(text, COMPUTED, {"worker": "decode-0"}) == 77
    assert sample_value(text, COMPUTED) == 5077
    assert sample_value(text, "pdserve_worker_pulled_tokens_total", {"worker": "decode-0"}) == 64
    tier_lines = [line for line in text.splitlines()
                  if line.startswith("pdserve_kv_tier_") and 'worker="decode-0"' in line]
    assert tier_lines == []


def test_a_worker_that_left_loses_its_series() -> None:
    m = RouterMetrics()
    m.kv_tiers.set("prefill-0", tiered_load())
    m.kv_tiers.set("decode-0", tiered_load(scale=3))
    m.remove_worker("decode-0")
    m.remove_worker("never-seen")  # harmless
    text = m.render().decode()
    assert 'worker="decode-0"' not in text
    assert sample_value(text, HITS) == 11 + 7 and sample_value(text, COMPUTED) == 5000


def test_router_processes_show_worker_counts_once() -> None:
    # every router process polls the same workers: the service shows one copy, not a sum
    own, child = RouterMetrics(), RouterMetrics()
    for m in (own, child):
        m.kv_tiers.set("prefill-0", tiered_load())
    child.count_request("ok")
    ended = totals_only(child.render().decode())  # a router process that ended
    assert COMPUTED not in ended and HITS not in ended
    assert 'pdserve_requests_total{status="ok"} 1.0' in ended
    merged = merge_expositions(own.render().decode(), [child.render().decode(), ended])
    assert sample_value(merged, HITS, {"tier": "host"}) == 11
    assert sample_value(merged, HIT_BYTES) == 18_000
    assert sample_value(merged, BLOCKS, {"tier": "disk"}) == 40
    assert sample_value(merged, COMPUTED) == 5000
    for name in PER_WORKER:
        assert sample_value(merged, name) == getattr(tiered_load(), PER_WORKER[name]), name
    assert sample_value(merged, "pdserve_requests_total", {"status": "ok"}) == 2  # summed


def test_router_counts_prefix_pulls_by_result() -> None:
    m = RouterMetrics()
    text = m.render().decode()
    for result in ("pulled", "held", "missed", "failed"):  # zeros from the first scrape
        assert sample_value(text, "pdserve_kv_pulls_total", {"result": result}) == 0
    m.count_pull("pulled", 4096, saved_s=0.25)
    m.count_pull("pulled", 1024, saved_s=-0.5)  # slower than recomputing: saved nothing
    m.count_pull("missed")
    text = m.render().decode()
    assert sample_value(text, "pdserve_kv_pulls_total", {"result": "pulled"}) == 2
    assert sample_value(text, "pdserve_kv_pulls_total", {"result": "missed"}) == 1
    assert sample_value(text, "pdserve_kv_pull_bytes_total") == 5120
    assert sample_value(text, "pdserve_kv_pull_saved_seconds_total") == 0.25
    with pytest.raises(ValueError, match="result must be one of"):
        m.count_pull("lost")
