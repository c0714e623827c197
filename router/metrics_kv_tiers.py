"""Each worker's KV tier counts and computed tokens, exported by the router as Prometheus series.

A worker with KV tiers under its device pool (engine/kv_tiers.py: host memory, then local disk)
counts, since it started and in blocks, its tier hits, the blocks written through to host
(stores), demoted to disk, promoted back, whose disk file failed its read, and that left the
last tier; it also reports the blocks each tier holds now. Every worker, tiers or not, counts
the tokens its engine ran through the model: what prefix-cache and tier hits save shows there
(a benchmark sums its increase over the prefill workers: prefill tokens computed), and the
prompt tokens it pulled from another decode worker's prefix cache, or whose pull failed (then
computed there): the remote tier, seen from the puller.

The router reads them with its load (proto/worker.proto WorkerLoad) and exports each worker's
as one series (label `worker`; the hit counts and the gauge also `tier`), like the speculative
decoding counts (router/metrics_speculation.py): a worker without tiers exports only its
computed tokens; a restarted worker counts from 0 again (a counter reset, which `rate()` and
`increase()` handle). A disk hit is a promotion started for a request; once promoted, the block
loads from host and counts as a host hit too, so host hits are all the blocks the tiers saved
recomputing. Every router process sees the same workers, so the service's /metrics shows the
service process's copy, never a sum over router processes (metrics_merge.WORKER_COUNTERS).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

from pdserve.proto import worker_pb2

logger = logging.getLogger(__name__)

TIERS: tuple[str, ...] = ("host", "disk")
# family name (exposed with `_total`) -> help; labels worker and tier
HIT_COUNTERS: dict[str, str] = {
    "pdserve_kv_tier_hits": "Prefix KV blocks a worker found in a KV tier instead of recomputing "
                            "them (disk: promoted to host, then counted under host as well).",
    "pdserve_kv_tier_hit_bytes": "Bytes of the KV blocks a worker found in a KV tier "
                                 "(hits times one block's bytes).",
}
# label worker; in the order of _Counts.tier_counts
TIER_COUNTERS: dict[str, str] = {
    "pdserve_kv_tier_stores": "KV blocks a worker wrote through from device to its host tier.",
    "pdserve_kv_tier_demotions": "KV blocks a worker demoted from its host tier to disk.",
    "pdserve_kv_tier_promotions": "KV blocks a worker promoted from disk to its host tier.",
    "pdserve_kv_tier_failed_promotions": "KV blocks whose disk file failed its read (missing, "
                                         "torn, corrupt or foreign): recomputed.",
    "pdserve_kv_tier_evictions": "KV blocks that left a worker's last tier.",
}
SAVED_SECONDS = "pdserve_kv_tier_saved_seconds"
SAVED_SECONDS_HELP = ("Prefill time a worker's KV tier hits saved: their tokens at its "
                      "measured prefill rate when they were loaded.")
COMPUTED_TOKENS = "pdserve_worker_computed_tokens"
COMPUTED_TOKENS_HELP = "Tokens a worker's engine ran through the model (prompts and decodes)."
PULLED_TOKENS = {
    "pdserve_worker_pulled_tokens": "Prompt tokens a decode worker pulled from another decode "
                                    "worker's prefix cache instead of computing them.",
    "pdserve_worker_failed_pull_tokens": "Prompt tokens whose pull from another decode worker "
                                         "failed or came too late: computed after all.",
}
TIER_BLOCKS = "pdserve_kv_tier_blocks"
TIER_BLOCKS_HELP = "KV blocks a worker's tier holds now."
# the counters a worker keeps and every router copies (metrics_merge.WORKER_COUNTERS)
WORKER_COUNTER_NAMES: frozenset[str] = frozenset(
    {*HIT_COUNTERS, *TIER_COUNTERS, COMPUTED_TOKENS, SAVED_SECONDS, *PULLED_TOKENS})


@dataclass(frozen=True)
class _Counts:
    """One load report's numbers (the message itself may be replaced under us)."""

    num_computed_tokens: int
    pulled_tokens: tuple[int, int]  # pulled, failed: PULLED_TOKENS' order
    block_bytes: int  # 0: no tiers
    hits: tuple[int, int]  # host, disk
    blocks: tuple[int, int]  # held now: host, disk
    # stores, demotions, promotions, failed promotions, evictions: TIER_COUNTERS' order
    tier_counts: tuple[int, int, int, int, int]
    saved_s: float

    @classmethod
    def of(cls, load: worker_pb2.WorkerLoad) -> _Counts:
        return cls(load.num_computed_tokens,
                   (load.num_pulled_tokens, load.num_failed_pull_tokens), load.kv_block_bytes,
                   (load.num_kv_host_hits, load.num_kv_disk_hits),
                   (load.num_kv_host_blocks, load.num_kv_disk_blocks),
                   (load.num_kv_stores, load.num_kv_demotions, load.num_kv_promotions,
                    load.num_kv_failed_promotions, load.num_kv_tier_evictions),
                   load.kv_tier_saved_s)


class KVTierMetrics:
    """A collector: the last counts each worker reported (set on the router's loop, read by
    the metrics thread)."""

    def __init__(self) -> None:
        self._counts: dict[str, _Counts] = {}
        self._lock = threading.Lock()

    def set(self, worker_id: str, load: worker_pb2.WorkerLoad) -> None:
        counts = _Counts.of(load)
        with self._lock:
            self._counts[worker_id] = counts

    def remove(self, worker_id: str) -> None:
        with self._lock:
            self._counts.pop(worker_id, None)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        with self._lock:
            counts = sorted(self._counts.items())
        computed = CounterMetricFamily(COMPUTED_TOKENS, COMPUTED_TOKENS_HELP, labels=["worker"])
        for worker_id, c in counts:
            computed.add_metric([worker_id], c.num_computed_tokens)
        yield computed
        for i, (name, help_text) in enumerate(PULLED_TOKENS.items()):
            family = CounterMetricFamily(name, help_text, labels=["worker"])
            for worker_id, c in counts:
                family.add_metric([worker_id], c.pulled_tokens[i])
            yield family
        tiered = [(worker_id, c) for worker_id, c in counts if c.block_bytes > 0]
        yield from _tier_families(tiered)


def _tier_families(tiered: list[tuple[str, _Counts]]) -> Iterator[
        CounterMetricFamily | GaugeMetricFamily]:
    """The tier series of the workers that have tiers."""
    hits, hit_bytes = (CounterMetricFamily(name, help_text, labels=["worker", "tier"])
                       for name, help_text in HIT_COUNTERS.items())
    blocks = GaugeMetricFamily(TIER_BLOCKS, TIER_BLOCKS_HELP, labels=["worker", "tier"])
    for worker_id, c in tiered:
        for tier, n, held in zip(TIERS, c.hits, c.blocks, strict=True):
            hits.add_metric([worker_id, tier], n)
            hit_bytes.add_metric([worker_id, tier], n * c.block_bytes)
            blocks.add_metric([worker_id, tier], held)
    yield from (hits, hit_bytes)
    for i, (name, help_text) in enumerate(TIER_COUNTERS.items()):
        family = CounterMetricFamily(name, help_text, labels=["worker"])
        for worker_id, c in tiered:
            family.add_metric([worker_id], c.tier_counts[i])
        yield family
    saved = CounterMetricFamily(SAVED_SECONDS, SAVED_SECONDS_HELP, labels=["worker"])
    for worker_id, c in tiered:
        saved.add_metric([worker_id], c.saved_s)
    yield saved
    yield blocks
