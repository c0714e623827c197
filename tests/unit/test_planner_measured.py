"""The planner's cost model from what the workers measure (planner.measured), by hand, and the
live planner reading it from the load reports the router holds."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from pdserve.engine.step_budget import StepFit
from pdserve.planner.live import LivePlanner
from pdserve.planner.measured import measured_perf
from pdserve.planner.policy import desired_workers
from pdserve.proto import worker_pb2
from tests.unit.test_planner_policy import PERF, POLICY, obs


def test_measured_model_by_hand():
    # a prefill worker of budget 512 whose step lasts 0.02 + 0.001 * p: a full step of 512
    # tokens takes 0.532 s, so it sustains 962.4 tok/s; another at 0.0005 s/token: 1808.5.
    fast = StepFit(0.02, 0.0005, 0.002)
    measured = measured_perf(PERF, [(StepFit(0.02, 0.001), 512), (fast, 512)], [])
    assert measured.prefill_tokens_per_s == pytest.approx((512 / 0.532 + 512 / 0.276) / 2)
    assert (measured.decode_a_s, measured.decode_b_s) == (PERF.decode_a_s, PERF.decode_b_s)
    assert measured.source == {"prefill": "measured by 2 workers", "decode": "profile"}
    # decode steps of 0.03 + 0.004 * d and 0.01 + 0.002 * d: a = 0.02, b = 0.003, c = 0;
    # a decode worker whose decode slope is not fitted yet (None) does not count
    measured = measured_perf(PERF, [], [StepFit(0.03, 0.001, 0.004), StepFit(0.01, 0.0, 0.002),
                                        StepFit(0.5, 0.001, None)])
    assert measured.prefill_tokens_per_s == PERF.prefill_tokens_per_s
    assert (measured.decode_a_s, measured.decode_b_s, measured.decode_c_s) == pytest.approx(
        (0.02, 0.003, 0.0))
    assert measured.decode_capacity(500, 0.25) == pytest.approx((0.25 - 0.02) / 0.003)
    # nothing measured: the profile itself, its source saying so
    assert replace(measured_perf(PERF, [], []), source={}) == PERF
    # the planner sizes from it: at 962.4 tok/s a 1000-token prompt is S = 1.04 s, the
    # M/D/1 bound at T = 2 s allows 2(2 - 1.04)/(4 - 1.04) = 0.649 of it: 624.2 tok/s, and
    # 1.5 req/s x 1000 tokens needs 2.4 -> 3 workers; the profile's 1000 tok/s also gives 3.
    slow = measured_perf(PERF, [(StepFit(0.02, 0.001), 512)], [])
    assert desired_workers(POLICY, slow, obs(rate=1.5)) == {"prefill": 3, "decode": 1}
    # at 1.3 req/s (1300 tok/s) the measured worker needs 2.08 -> 3, the profile 1.95 -> 2
    assert desired_workers(POLICY, slow, obs(rate=1.3))["prefill"] == 3
    assert desired_workers(POLICY, PERF, obs(rate=1.3))["prefill"] == 2


def worker(load: worker_pb2.WorkerLoad, draining: bool = False) -> SimpleNamespace:
    """What the planner reads of a router's worker client: its last load, whether it drains."""
    return SimpleNamespace(load=load, draining=draining)


def test_the_live_planner_prices_workers_by_the_fits_they_report():
    fitted = worker_pb2.WorkerLoad(step_token_budget=512, step_intercept_s=0.02,
                                   prefill_s_per_token=0.001, step_slope_fitted=True)
    unfitted = worker_pb2.WorkerLoad(step_token_budget=512, step_intercept_s=0.5,
                                     prefill_s_per_token=0.1, step_slope_fitted=False)
    draining = worker_pb2.WorkerLoad(step_token_budget=512, prefill_s_per_token=1.0,
                                     step_slope_fitted=True)
    decoding = worker_pb2.WorkerLoad(step_token_budget=256, step_intercept_s=0.03,
                                     prefill_s_per_token=0.001, decode_s_per_token=0.004)
    router = SimpleNamespace(
        prefill={"p0": worker(fitted), "p1": worker(unfitted),
                 "p2": worker(draining, draining=True), "p3": worker(None)},
        decode={"d0": worker(decoding)})
    planner = LivePlanner(POLICY, PERF, router, pool=None, make_spec=None)
    model = planner.cost_model()
    assert model.prefill_tokens_per_s == pytest.approx(512 / 0.532)  # p0's alone
    assert (model.decode_a_s, model.decode_b_s, model.decode_c_s) == pytest.approx(
        (0.03, 0.004, 0.0))
    assert model.source == {"prefill": "measured by 1 worker", "decode": "measured by 1 worker"}
    planner.policy = replace(POLICY, cost_model="profile")
    assert planner.cost_model() == PERF
