"""One service's metrics from several router processes' expositions (`--router-processes`).

Each router process keeps its own registry; the service process serves the whole service on
its /metrics. The rule, per family: counters, histograms and summaries are summed sample by
sample (same name, same labels), as are the gauges of work held by a router
(`SUMMED_GAUGES`: its queue and in-flight requests); every other gauge (a worker's health and
KV blocks, Redis health, the planner's wish, `_created` timestamps) and the counters workers
report (`WORKER_COUNTERS`: speculative decoding, KV tiers, computed tokens) are the service
process's own, because every router sees the same workers. A summed sample that only another
process has (a label set the first never used) is added as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pdserve.router.metrics_kv_tiers import WORKER_COUNTER_NAMES
from pdserve.router.metrics_speculation import SPEC_COUNTERS

logger = logging.getLogger(__name__)

# gauges that count what one router holds: the service's value is the sum over routers
SUMMED_GAUGES: frozenset[str] = frozenset({"pdserve_queue_depth", "pdserve_requests_inflight"})
# counters a worker keeps and every router copies from its load reports: never summed
WORKER_COUNTERS: frozenset[str] = frozenset(SPEC_COUNTERS) | WORKER_COUNTER_NAMES
_SUMMED_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram"})


def is_summed(family: Metric) -> bool:
    if family.name in WORKER_COUNTERS:
        return False
    return family.type in _SUMMED_TYPES or family.name in SUMMED_GAUGES


def merge_families(own: Iterable[Metric], others: Sequence[Iterable[Metric]]) -> list[Metric]:
    """`own`'s families, their summed ones plus every other process's samples."""
    merged = [_copy(f) for f in own]
    by_name = {f.name: f for f in merged}
    for families in others:
        for family in families:
            if not is_summed(family):
                continue
            target = by_name.get(family.name)
            if target is None:
                target = by_name[family.name] = _copy(family, samples=False)
                merged.append(target)
            elif target.type != family.type:
                logger.warning("metric %s is a %s here but a %s in another router process: "
                               "not summed", family.name, target.type, family.type)
                continue
            _add_samples(target, family.samples)
    return merged


def merge_expositions(own: str, others: Sequence[str]) -> str:
    """`merge_families` over Prometheus text expositions; the result in the same format."""
    families = merge_families(parse(own), [parse(text) for text in others])
    return render(families)


def totals_only(text: str) -> str:
    """What a router process leaves behind when it ends: its counters and histograms (the
    service's totals must not go down), none of its gauges nor its copies of workers'
    counters (the workers still count)."""
    return render([f for f in parse(text)
                   if f.type in _SUMMED_TYPES and f.name not in WORKER_COUNTERS])


def parse(text: str) -> list[Metric]:
    return list(text_string_to_metric_families(text)) if text else []


def render(families: Iterable[Metric]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families)))
    return generate_latest(registry).decode()


def _copy(family: Metric, samples: bool = True) -> Metric:
    copy = Metric(family.name, family.documentation, family.type, family.unit)
    if samples:
        copy.samples = list(family.samples)
    return copy


def _add_samples(target: Metric, samples: Iterable[Sample]) -> None:
    index = {_key(s): i for i, s in enumerate(target.samples)}
    for sample in samples:
        i = index.get(_key(sample))
        if i is None:
            index[_key(sample)] = len(target.samples)
            target.samples.append(sample)
        else:
            old = target.samples[i]
            target.samples[i] = old._replace(value=old.value + sample.value)


def _key(sample: Sample) -> tuple[str, tuple[tuple[str, str], ...]]:
    return sample.name, tuple(sorted(sample.labels.items()))


class _Families:
    """A collector yielding fixed families (what `render` hands to prometheus_client)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
