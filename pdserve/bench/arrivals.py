"""Send-time schedules for open-loop benchmarks: seconds after the run starts, one per request.

Poisson arrivals with a burstiness factor, as vLLM's `bench serve --burstiness`: the gaps
between sends are Gamma(shape=burstiness, scale=1 / (rate * burstiness)), so their mean is
1 / rate whatever the burstiness and their coefficient of variation is 1 / sqrt(burstiness):
burstiness 1 gives exponential gaps (a Poisson process), < 1 burstier (clusters and lulls),
> 1 smoother (towards a fixed rate).

First-arrival convention: request i is sent at the sum of the first i + 1 gaps, so the first
request waits one gap — the arrival times of a Poisson process observed from t = 0 (as vLLM
does). n requests then span n / rate seconds on average, and the offered rate over the
schedule is `rate`. `fixed_times` follows the same convention: request i at (i + 1) / rate.
Unlike vLLM, the gaps are not rescaled to make the last send land exactly at n / rate (that
would correlate the gaps). `rate = inf` sends everything at 0 (a burst; the runner's
concurrency limit then decides the pace).
"""

from __future__ import annotations

import math

import numpy as np


def _check(n: int, rate: float) -> None:
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s (inf = all at once), got {rate}")


def poisson_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """n non-decreasing send times with gamma-distributed gaps of mean 1 / rate."""
    _check(n, rate)
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be > 0 (1 = Poisson), got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.cumsum(gaps).tolist()


def fixed_times(n: int, rate: float) -> list[float]:
    """n evenly spaced send times, 1 / rate apart, the first at 1 / rate."""
    _check(n, rate)
    if math.isinf(rate):
        return [0.0] * n
    return [(i + 1) / rate for i in range(n)]
