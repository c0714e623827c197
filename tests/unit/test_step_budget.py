"""engine.step_budget: the online step-time fit, the token budget it implies, and the
shortest-remaining-prefill-first order with aging; SchedulerConfig's fields for them."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.request import RequestStatus
from pdserve.engine.step_budget import (
    COLD_START_TOKENS,
    FALLBACK_TOKENS_PER_S,
    StepFit,
    StepTimeModel,
    srpt_key,
    srpt_order,
    token_budget,
    tokens_per_s,
)

SIZES = (512, 37, 2048, 1, 300, 1500, 64, 999)


def fed(a: float, b: float, sizes=SIZES, model: StepTimeModel | None = None) -> StepTimeModel:
    model = model or StepTimeModel()
    for n in sizes:
        model.observe(n, a + b * n)
    return model


def test_fit_recovers_an_exact_line():
    fit = fed(0.012, 3e-5).fit()
    assert fit.intercept_s == pytest.approx(0.012, rel=1e-9)
    assert fit.per_token_s == pytest.approx(3e-5, rel=1e-9)
    assert fit.seconds(100) == pytest.approx(0.012 + 100 * 3e-5)


def test_fit_stays_exact_over_many_observations():
    sizes = [SIZES[i % len(SIZES)] for i in range(5000)]
    fit = fed(0.002, 1e-6, sizes).fit()
    assert fit.intercept_s == pytest.approx(0.002, rel=1e-6)
    assert fit.per_token_s == pytest.approx(1e-6, rel=1e-6)


def test_fit_forgets_an_old_regime():
    model = fed(0.02, 4e-5, SIZES * 5)
    model = fed(0.01, 2e-5, SIZES * 8, model)  # the machine got faster (or less loaded)
    fit = model.fit()
    assert fit.intercept_s == pytest.approx(0.01, rel=0.01)
    assert fit.per_token_s == pytest.approx(2e-5, rel=0.01)


def test_the_mean_cost_per_token_until_clearly_different_sizes():
    model = StepTimeModel()
    assert model.fit() is None
    for _ in range(20):
        model.observe(128, 0.05)
    model.observe(130, 0.0502)  # 2 % apart: noise would decide the slope
    assert model.fit().intercept_s == 0.0
    assert model.fit().per_token_s == pytest.approx((20 * 0.05 + 0.0502) / (20 * 128 + 130),
                                                    rel=0.01)
    for bad in ((0, 0.1), (64, math.nan), (64, math.inf), (64, -1.0)):  # taught nothing
        model.observe(*bad)
    assert model.fit().intercept_s == 0.0 and model.num_observations == 21
    model.observe(256, 0.09)
    assert model.fit().intercept_s > 0 and model.fit().per_token_s > 0


def test_one_size_for_a_long_time_keeps_the_slope_and_moves_the_level():
    model = fed(0.01, 1e-4)
    for _ in range(400):  # the other sizes fade to nothing: the slope is no longer refitted
        model.observe(256, 0.01 + 1e-4 * 256)
    assert model.fit().per_token_s == pytest.approx(1e-4, rel=1e-6)
    for _ in range(100):  # the same size, twice as slow (the machine got busier)
        model.observe(256, 2 * (0.01 + 1e-4 * 256))
    fit = model.fit()
    assert fit.per_token_s == pytest.approx(1e-4, rel=1e-6)
    assert fit.seconds(256) == pytest.approx(2 * (0.01 + 1e-4 * 256), rel=1e-4)


def test_budget_sized_steps_settle_on_the_target_when_the_machine_changes():
    """The loop the scheduler runs: size a step from the fit, time it, teach the fit."""
    model = fed(0.01, 1e-4)
    for a, b in ((0.02, 2e-4), (0.005, 5e-5)):  # the machine slows down, then speeds up
        for _ in range(150):
            n = token_budget(model.fit(), 0.1, 16, 4096)
            model.observe(n, a + b * n)
        assert a + b * n == pytest.approx(0.1, rel=0.02), (a, b)


def test_decay_is_validated():
    for bad in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="decay"):
            StepTimeModel(bad)


def test_token_budget_hits_the_target_on_the_line():
    for a, b, target in itertools.product((0.0, 0.003, 0.02), (1e-6, 7e-5, 3e-3), (0.025, 0.1)):
        fit = StepFit(a, b)
        n = token_budget(fit, target, 1, 10**9)
        assert fit.seconds(n) <= target + 1e-12 and fit.seconds(n + 1) > target, (a, b, target)


def test_token_budget_clamps_to_floor_and_cap():
    fit = StepFit(0.01, 1e-4)  # 0.05 s -> 400 tokens
    assert token_budget(fit, 0.05, 16, 2048) == 400
    assert token_budget(fit, 0.05, 16, 256) == 256
    assert token_budget(fit, 0.05, 500, 2048) == 500
    assert token_budget(fit, 0.005, 16, 2048) == 16  # below the fixed cost: floor
    assert token_budget(fit, 10.0, 16, 2048) == 2048
    assert token_budget(fit, 0.05, 4096, 2048) == 2048  # floor above cap: cap wins


def test_token_budget_cold_or_without_a_usable_fit():
    assert token_budget(None, 0.05, 16, 2048) == COLD_START_TOKENS
    assert token_budget(None, 0.05, 16, 100) == 100
    assert token_budget(None, 0.05, 300, 2048) == 300
    assert token_budget(StepFit(0.01, 0.0), 0.05, 16, 2048) == 2048
    assert token_budget(StepFit(0.01, -1e-5), 0.05, 16, 2048) == 2048


def test_tokens_per_s_from_the_slope_or_the_fallback():
    assert tokens_per_s(StepFit(0.01, 1e-4)) == pytest.approx(1e4 / 1)
    assert tokens_per_s(StepFit(0.01, 2e-5)) == pytest.approx(50_000)
    assert tokens_per_s(None) == FALLBACK_TOKENS_PER_S
    assert tokens_per_s(StepFit(0.01, 0.0)) == FALLBACK_TOKENS_PER_S


@dataclass
class Queued:
    name: str
    num_tokens: int
    arrival_time: float
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0


def names(queue) -> list[str]:
    return [r.name for r in queue]


def test_shortest_remaining_prefill_goes_first():
    queue = [Queued("long", 4000, 0.0), Queued("mid", 1000, 0.0), Queued("short", 10, 0.0)]
    assert names(srpt_order(queue, now=0.0, rate=1000.0)) == ["short", "mid", "long"]


def test_aging_lets_an_old_long_prompt_overtake():
    old_long = Queued("old long", 10_000, arrival_time=0.0)  # 10 s of work at 1000 tokens/s
    for now, first in ((5.0, "new short"), (9.0, "new short"), (10.0, "old long")):
        new_short = Queued("new short", 100, arrival_time=now)  # 0.1 s of work, just arrived
        assert names(srpt_order([old_long, new_short], now, 1000.0))[0] == first, now
    assert srpt_key(10_000, 10.0, 1000.0) < srpt_key(100, 0.0, 1000.0)


def test_preempted_requests_keep_the_front_in_their_order():
    queue = [Queued("p2", 900, 5.0, RequestStatus.PREEMPTED),
             Queued("w", 1, 0.0),
             Queued("p1", 50, 1.0, RequestStatus.PREEMPTED)]
    assert names(srpt_order(queue, 6.0, 1000.0)) == ["p2", "p1", "w"]


def test_ties_are_first_come_first_served():
    queue = [Queued("b", 100, 1.0), Queued("c", 100, 1.0), Queued("a", 100, 0.5)]
    # a: 0.1 - 0.5; b and c: 0.1 - 0.0, the same key and arrival: queue order
    assert names(srpt_order(queue, 1.0, 1000.0)) == ["a", "b", "c"]


def test_order_exhaustively_on_small_queues():
    """Every queue of up to three requests over a few sizes, arrivals and statuses: preempted
    first in queue order, then keys non-decreasing, equal keys by arrival then queue order."""
    kinds = list(itertools.product((1, 2, 5), (0.0, 0.001, 0.003),
                                   (RequestStatus.WAITING, RequestStatus.PREEMPTED)))
    for size in range(4):
        for combo in itertools.product(kinds, repeat=size):
            queue = [Queued(str(i), n, t, s) for i, (n, t, s) in enumerate(combo)]
            got = srpt_order(queue, 0.01, 1000.0)
            assert sorted(names(got)) == names(queue)
            pre = [r for r in queue if r.status is RequestStatus.PREEMPTED]
            assert got[:len(pre)] == pre
            rest = got[len(pre):]
            for x, y in itertools.pairwise(rest):
                kx = srpt_key(x.num_tokens, 0.01 - x.arrival_time, 1000.0)
                ky = srpt_key(y.num_tokens, 0.01 - y.arrival_time, 1000.0)
                assert (kx, x.arrival_time, int(x.name)) < (ky, y.arrival_time, int(y.name))


def test_order_counts_only_the_tokens_left():
    done_most = Queued("resumed", 1000, 0.0, num_computed_tokens=990)
    assert names(srpt_order([Queued("fresh", 20, 0.0), done_most], 0.0, 1000.0))[0] == "resumed"


def test_scheduler_config_defaults_keep_todays_behaviour():
    config = SchedulerConfig(4, 64)  # positional, as callers write it
    assert (config.step_target_s, config.scheduling_policy) == (None, "fcfs")
    assert SchedulerConfig(step_target_s=0.05, scheduling_policy="srpt").step_target_s == 0.05
    assert SchedulerConfig(step_target_s=1).step_target_s == 1


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, math.nan, math.inf, True, "0.05"])
def test_scheduler_config_refuses_a_bad_step_target(bad):
    with pytest.raises(ValueError, match="step_target_s"):
        SchedulerConfig(step_target_s=bad)


def test_scheduler_config_refuses_an_unknown_policy_naming_the_choices():
    with pytest.raises(ValueError, match="scheduling_policy.*fcfs.*srpt.*'lifo'"):
        SchedulerConfig(scheduling_policy="lifo")


def test_fit_recovers_prompt_and_decode_slopes_apart():
    model = StepTimeModel()
    a, bp, bd = 0.01, 1e-3, 3e-3  # a decode token costs three prompt tokens
    for p, d in itertools.product((0, 64, 300), (1, 8, 32)):
        model.observe(p + d, a + bp * p + bd * d, num_decodes=d)
    fit = model.fit()
    assert (fit.intercept_s, fit.per_token_s, fit.per_decode_s) == pytest.approx((a, bp, bd))
    assert model.slope_fitted and model.decode_slope_fitted
    assert fit.seconds(40, 8) == pytest.approx(a + bp * 32 + bd * 8)


def test_decode_steps_alone_fit_the_decode_slope_and_price_prompts_with_it():
    model = StepTimeModel()
    for d in (1, 4, 16, 2, 9):
        model.observe(d, 0.01 + 2e-3 * d, num_decodes=d)
    fit = model.fit()
    assert model.decode_slope_fitted and not model.slope_fitted  # no prompt sizes seen
    assert fit.per_decode_s == pytest.approx(2e-3) and fit.per_token_s == fit.per_decode_s
    assert fit.intercept_s == pytest.approx(0.01)


def test_sizes_that_move_together_get_one_slope():
    model = StepTimeModel()
    for d in (1, 3, 8, 20):  # every step: 10 prompt tokens per decode token
        model.observe(11 * d, 0.005 + 1e-3 * 11 * d, num_decodes=d)
    fit = model.fit()
    assert fit.per_token_s == pytest.approx(fit.decode_s) == pytest.approx(1e-3)
    assert fit.intercept_s == pytest.approx(0.005)


def test_token_budget_leaves_the_decodes_their_cost():
    fit = StepFit(0.01, 1e-3, 2e-3)
    # 10 decodes cost 0.01 + 0.02; 0.07 s are left for 70 prompt tokens: 80 in all
    assert token_budget(fit, 0.1, 1, 4096, num_decodes=10) == 80
    assert fit.seconds(80, 10) == pytest.approx(0.1)
    assert token_budget(fit, 0.02, 11, 4096, num_decodes=10) == 11  # decodes alone overrun
