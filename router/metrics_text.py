"""Reading Prometheus text exposition back: quantiles from cumulative histogram buckets.

The benchmark compares the medians it measured client-side with what the router's histograms
say; this estimates a quantile exactly as PromQL's `histogram_quantile` does, so the two
numbers can be compared without running a Prometheus server.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)


def histogram_buckets(
    text: bytes | str, metric_name: str, labels: Mapping[str, str] | None = None
) -> list[tuple[float, float]]:
    """Cumulative buckets `(upper_bound, count)` of `metric_name`, sorted by upper bound.

    Series matching `labels` (all of them when None) are summed per `le`, like
    `sum by (le) (metric_bucket)`. `metric_name` may be given with or without `_bucket`.
    Raises ValueError when no bucket of that metric is in `text`.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    base = metric_name.removesuffix("_bucket")
    wanted = dict(labels or {})
    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != base + "_bucket" or "le" not in sample.labels:
                continue
            if any(sample.labels.get(k) != v for k, v in wanted.items()):
                continue
            le = float(sample.labels["le"])
            counts[le] = counts.get(le, 0.0) + sample.value
    if not counts:
        raise ValueError(f"no histogram buckets named {base}_bucket matching {wanted} in text")
    return sorted(counts.items())


def sample_value(text: bytes | str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum of every sample named `name` whose labels include `labels` (0 when none)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    wanted = dict(labels or {})
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in wanted.items())
    )


def histogram_quantile(
    text: bytes | str, metric_name: str, q: float, labels: Mapping[str, str] | None = None
) -> float:
    """Estimate the q-quantile (0 <= q <= 1) of a histogram in exposition text.

    As Prometheus does: find the bucket holding rank q * count and interpolate linearly
    between its lower and upper bound (the first bucket's lower bound is 0); a rank in the
    +Inf bucket returns the largest finite bound. NaN for an empty histogram.
    """
    return bucket_quantile(histogram_buckets(text, metric_name, labels), q)


def quantile_between(before: bytes | str, after: bytes | str, metric_name: str,
                     q: float) -> float:
    """The q-quantile of what a histogram observed between two scrapes (NaN if nothing)."""
    start = dict(histogram_buckets(before, metric_name))
    delta = [(le, n - start.get(le, 0.0)) for le, n in histogram_buckets(after, metric_name)]
    return bucket_quantile(delta, q)


def bucket_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """The q-quantile of cumulative `(upper_bound, count)` buckets (e.g. the difference of
    two scrapes, for what happened between them), interpolated as `histogram_quantile` does."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not buckets or not math.isinf(buckets[-1][0]) or len(buckets) < 2:
        logger.warning("histogram lacks a +Inf bucket or finite buckets")
        return math.nan
    # Cumulative counts must not decrease; scrapes racing observations can break that.
    fixed: list[tuple[float, float]] = []
    running = 0.0
    for upper, count in buckets:
        running = max(running, count)
        fixed.append((upper, running))
    total = fixed[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    b = next(i for i, (_, count) in enumerate(fixed) if count >= rank)
    if b == len(fixed) - 1:
        return fixed[-2][0]
    upper, count = fixed[b]
    if b == 0 and upper <= 0:
        return upper
    lower, below = (0.0, 0.0) if b == 0 else fixed[b - 1]
    in_bucket = count - below
    if in_bucket == 0:
        return lower
    return lower + (upper - lower) * (rank - below) / in_bucket
