"""Arrival schedules: gamma gaps with mean 1 / rate and CV 1 / sqrt(burstiness), seeded."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.arrivals import fixed_times, poisson_times

N = 50_000


def _gaps(times: list[float]) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], times]))  # the first request waits one gap


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_gap_is_one_over_rate(burstiness):
    rate = 4.0
    gaps = _gaps(poisson_times(N, rate, burstiness, seed=11))
    # Gamma(k, 1 / (rate k)): mean 1 / rate, sd (1 / rate) / sqrt(k). The sample mean of N
    # gaps has standard error sd / sqrt(N); 5 standard errors: a false alarm ~ 6e-7.
    se = (1 / rate) / math.sqrt(burstiness) / math.sqrt(N)
    assert abs(gaps.mean() - 1 / rate) < 5 * se


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_the_coefficient_of_variation(burstiness):
    gaps = _gaps(poisson_times(N, 2.0, burstiness, seed=5))
    cv2 = gaps.var() / gaps.mean() ** 2
    # Theory: CV^2 = 1 / k. Gamma's excess kurtosis is 6 / k, so the sample variance has
    # relative standard error sqrt((2 + 6 / k) / N) and the mean CV / sqrt(N) = 1 / sqrt(kN);
    # CV^2 = var / mean^2 then has relative error at most sqrt((2 + 6/k)/N) + 2 / sqrt(kN).
    k = burstiness
    rel_se = math.sqrt((2 + 6 / k) / N) + 2 / math.sqrt(k * N)
    assert abs(cv2 * k - 1) < 5 * rel_se


def test_cv_orders_by_burstiness():
    cvs = []
    for k in (0.25, 1.0, 4.0):
        g = _gaps(poisson_times(10_000, 1.0, k, seed=0))
        cvs.append(g.std() / g.mean())
    assert cvs[0] > cvs[1] > cvs[2]


def test_seeded_sorted_and_first_at_its_gap():
    a = poisson_times(100, 3.0, 0.5, seed=9)
    assert a == poisson_times(100, 3.0, 0.5, seed=9)
    assert a != poisson_times(100, 3.0, 0.5, seed=10)
    assert all(x <= y for x, y in zip(a, a[1:]))
    assert a[0] > 0.0  # the first request waits its first gap (not sent at 0)


def test_infinite_rate_and_empty():
    assert poisson_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert fixed_times(2, math.inf) == [0.0, 0.0]
    assert poisson_times(0, 1.0) == [] and fixed_times(0, 1.0) == []


def test_fixed_times():
    assert fixed_times(3, 2.0) == pytest.approx([0.5, 1.0, 1.5])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 3, "rate": 0.0}, "rate"),
        ({"n": 3, "rate": -1.0}, "rate"),
        ({"n": 3, "rate": math.nan}, "rate"),
        ({"n": -1, "rate": 1.0}, "number of requests"),
        ({"n": 3, "rate": 1.0, "burstiness": 0.0}, "burstiness"),
        ({"n": 3, "rate": 1.0, "burstiness": math.inf}, "burstiness"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        poisson_times(**kwargs)
    if "burstiness" not in kwargs:
        with pytest.raises(ValueError, match=match):
            fixed_times(**kwargs)
