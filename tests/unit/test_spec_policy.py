"""StepCost's decayed least-squares fit and SpecPolicy's rule: speculate iff
(B + sum E(k_i)) / (t(B + K) + P) >= B / t(B), probing every PROBE_EVERY-th step while off."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from pdserve.engine.spec.policy import (
    DECAY,
    MAX_PROBE_EVERY,
    PROBE_EVERY,
    SpecPolicy,
    StepCost,
    expected_accepted,
)


def _cost(a: float, b: float, sizes: list[int]) -> StepCost:
    cost = StepCost()
    for tokens in sizes:
        cost.observe(tokens, a + b * tokens)
    return cost


@pytest.mark.parametrize("a,b", [(0.02, 1e-4), (0.0, 3e-3), (1.5, 0.25), (0.004, 0.0)])
def test_fit_recovers_a_and_b_from_exact_observations(a: float, b: float) -> None:
    rng = random.Random(0)
    fit = _cost(a, b, [rng.randint(1, 512) for _ in range(200)]).fit()
    assert fit is not None
    assert fit[0] == pytest.approx(a, rel=1e-6, abs=1e-12)
    assert fit[1] == pytest.approx(b, rel=1e-6, abs=1e-12)


def test_three_observations_of_two_sizes_give_the_line() -> None:
    assert _cost(0.5, 0.01, [10, 30, 10]).fit() == pytest.approx((0.5, 0.01))


def test_two_observations_of_two_sizes_are_enough() -> None:
    assert _cost(0.5, 0.01, [10, 30]).fit() == pytest.approx((0.5, 0.01))


def test_no_fit_until_two_step_sizes_are_seen() -> None:
    assert StepCost().fit() is None
    assert _cost(0.5, 0.01, [64]).fit() is None
    assert _cost(0.5, 0.01, [64] * 500).fit() is None  # many steps, one size: no slope


def test_fit_is_least_squares_over_decayed_observations() -> None:
    # Noisy observations, and a step cost that changes half-way: the fit is the weighted
    # least-squares line with weight DECAY**age, so it follows the recent cost.
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 300, 120)
    slope = np.where(np.arange(120) < 60, 2e-4, 5e-4)
    seconds = 0.01 + slope * sizes + rng.normal(0, 1e-3, 120)
    cost = StepCost()
    for tokens, s in zip(sizes.tolist(), seconds.tolist()):
        cost.observe(tokens, s)
    sqrt_w = np.sqrt(DECAY ** np.arange(119, -1, -1))
    design = np.stack([np.ones(120), sizes], axis=1)
    (a, b), *_ = np.linalg.lstsq(design * sqrt_w[:, None], seconds * sqrt_w, rcond=None)
    assert a > 0 and b > 0  # no clamping in play
    assert cost.fit() == pytest.approx((a, b), rel=1e-6)


def test_fit_clamps_to_non_negative() -> None:
    shrinking = _cost(1.0, -0.001, [10, 200, 50, 400])  # time falls with tokens: b -> 0
    sizes = [10, 200, 50, 400]
    weights = [DECAY ** (len(sizes) - 1 - i) for i in range(len(sizes))]
    mean = sum(w * (1.0 - 0.001 * t) for w, t in zip(weights, sizes)) / sum(weights)
    assert shrinking.fit() == pytest.approx((mean, 0.0))
    a, b = _cost(-1.0, 2.0, [10, 20, 40]).fit()  # negative intercept -> 0, slope kept
    assert a == 0.0 and b == pytest.approx(2.0)


def _policy(a: float, b: float, alpha: float, propose_s: float | None = None) -> SpecPolicy:
    """A policy whose cost fit is t(T) = a + b*T and whose measured acceptance is alpha."""
    return SpecPolicy(_cost(a, b, [1, 8, 64, 256]), alpha=alpha, propose_s=propose_s)


def _expected_run(alpha: float, k: int) -> float:
    """E(k) by its definition: sum over j of P(the first j drafts all hold)."""
    return sum(alpha**j for j in range(1, k + 1))


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_expected_accepted_is_the_mean_run_of_held_drafts(alpha: float, k: int) -> None:
    assert expected_accepted(alpha, k) == pytest.approx(_expected_run(alpha, k))


def test_speculates_before_anything_is_known() -> None:
    assert SpecPolicy(StepCost()).should_speculate(8, [4] * 8)
    fitted_only = SpecPolicy(_cost(0.0, 1.0, [1, 2]))  # a fit but no acceptance yet
    assert fitted_only.should_speculate(8, [4] * 8)
    no_fit = SpecPolicy(_cost(0.0, 1.0, [4]))
    no_fit.record(16, 0)  # acceptance known (zero), no fit yet
    assert no_fit.should_speculate(4, [4] * 4)


def test_low_acceptance_with_linear_step_cost_turns_speculation_off() -> None:
    # Cost proportional to tokens: 4 drafts each holding half the time cannot pay.
    assert not _policy(0.0, 1e-3, 0.5).should_speculate(8, [4] * 8)


def _rule(a, b, alpha, drafts, p, batch):
    """Both sides of the docstring's inequality, cross-multiplied."""
    gain = sum(_expected_run(alpha, k) for k in drafts)
    return (batch + gain) * (a + b * batch), batch * (a + b * (batch + sum(drafts)) + p)


def test_the_rule_on_both_sides() -> None:
    outcomes = []
    grid = itertools.product([0.0, 0.01, 0.05], [1e-5, 1e-4, 1e-3], [1, 8, 32],
                             [0.0, 0.3, 0.6, 0.9], [1, 4], [0.0, 1e-3], [1.0, 0.25])
    for a, b, batch, alpha, k, p, share in grid:
        drafts = [k] * max(1, int(batch * share))  # not every sequence has drafts
        lhs, rhs = _rule(a, b, alpha, drafts, p, batch)
        if abs(lhs - rhs) <= 1e-9 * max(lhs, rhs):
            continue  # a tie: the fit's rounding may land on either side
        decided = _policy(a, b, alpha).should_speculate(batch, drafts, p)
        assert decided == (lhs >= rhs), (a, b, batch, alpha, k, p, share)
        outcomes.append(lhs >= rhs)
    assert True in outcomes and False in outcomes
    assert len(outcomes) > 300


def test_probes_get_rarer_while_they_keep_failing() -> None:
    policy = _policy(0.0, 1e-3, 0.0)  # nothing accepted: off
    probes = []
    for step in range(1200):
        if policy.should_speculate(8, [4] * 8):
            probes.append(step)
            policy.record(32, 0)  # the probe still accepts nothing
        else:
            policy.record(0, 0)
    gaps = [b - a for a, b in zip([-1, *probes], probes)]
    want, every = [], PROBE_EVERY
    while sum(want) + every <= 1200:
        want.append(every)
        every = min(2 * every, MAX_PROBE_EVERY)
    assert gaps == want and want[-1] == MAX_PROBE_EVERY


def test_a_probe_that_finds_good_acceptance_turns_speculation_back_on() -> None:
    # Step time dominated by its fixed part (memory-bound decode): accepted drafts pay.
    policy = _policy(0.02, 1e-5, 0.0, 1e-4)
    assert not policy.should_speculate(8, [4] * 8, 1e-4)
    for _ in range(PROBE_EVERY - 1):
        policy.record(0, 0)
    assert policy.should_speculate(8, [4] * 8, 1e-4)  # the probe
    policy.record(32, 28, 1e-4)  # the text turned repetitive: 28 of 32 drafts held
    lhs, rhs = _rule(0.02, 1e-5, policy.alpha, [4] * 8, policy.propose_s, 8)
    assert lhs > rhs
    for _ in range(3 * PROBE_EVERY):  # on at every step now, not only at probes
        assert policy.should_speculate(8, [4] * 8, policy.propose_s)
        policy.record(32, 28, 1e-4)
    assert policy.probe_every == PROBE_EVERY


def test_record_measures_the_acceptance_rate_and_moves_toward_new_steps() -> None:
    policy = SpecPolicy(StepCost())
    policy.record(12, 6, 0.002)
    assert (policy.alpha, policy.propose_s) == (0.5, 0.002)  # the first step, as measured
    policy.record(0, 0)  # a step without drafts measures nothing
    assert (policy.alpha, policy.propose_s) == (0.5, 0.002)
    assert policy.steps_off == 1
    policy.record(8, 8, 0.004)
    assert policy.steps_off == 0
    assert 0.5 < policy.alpha < 1.0 and 0.002 < policy.propose_s < 0.004
    policy.record(8, 8)  # a cheap proposer's step: its time is not the policy's P
    for _ in range(200):
        policy.record(8, 8, 0.004)
    assert policy.alpha == pytest.approx(1.0) and policy.propose_s == pytest.approx(0.004)
