"""CountingHistogram: a Prometheus histogram cheap enough to observe once per streamed token.

prometheus_client's Histogram takes a lock and scans its bucket bounds linearly on every
observation: with the 121 inter-token buckets that is several microseconds, paid per token
on the router's one event-loop thread. This one finds the bucket by bisection and adds a
count for n equal observations at once; the bounds are cumulated only when scraped. Observed
from one thread (the event loop); a scrape from another thread reads a snapshot, which may
lag the sum by the observation in progress, never more.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class CountingHistogram:
    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds != list(dict.fromkeys(bounds)):
            raise ValueError(f"buckets must be distinct numbers, got {buckets!r}")
        self.name, self.documentation = name, documentation
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float, n: int = 1) -> None:
        """`n` observations of `value`."""
        self._counts[bisect.bisect_left(self._bounds, value)] += n
        self._sum += value * n

    def collect(self) -> Iterator[HistogramMetricFamily]:
        counts, total = list(self._counts), self._sum
        buckets, cumulative = [], 0
        for bound, count in zip([*self._bounds, float("inf")], counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets,
                                    sum_value=total)

