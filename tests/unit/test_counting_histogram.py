"""CountingHistogram exports what prometheus_client's Histogram would, for the same observations."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdserve.router.histogram import CountingHistogram
from pdserve.router.metrics import ITL_BUCKETS


def _series(registry: CollectorRegistry) -> dict[str, float]:
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_buckets_count_and_sum_as_prometheus_histogram(seed: int) -> None:
    rng = random.Random(seed)
    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours = CountingHistogram("x_seconds", "x", ITL_BUCKETS, ours_reg)
    theirs = Histogram("x_seconds", "x", buckets=ITL_BUCKETS, registry=theirs_reg)
    # exact bounds included: a value equal to a bound belongs to that bucket (le)
    values = [10 ** rng.uniform(-5, 2.5) for _ in range(500)] + list(ITL_BUCKETS[::7])
    for value in values:
        n = rng.choice([1, 1, 3])
        ours.observe(value, n)
        for _ in range(n):
            theirs.observe(value)
    mine, reference = _series(ours_reg), _series(theirs_reg)
    assert mine.keys() == reference.keys()
    for name, value in reference.items():
        assert mine[name] == pytest.approx(value, rel=1e-12), name


def test_buckets_must_be_distinct() -> None:
    with pytest.raises(ValueError, match="buckets"):
        CountingHistogram("y", "y", [0.1, 0.1], CollectorRegistry())
