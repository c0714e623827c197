"""The planner policy: load_policy validation and the pure decide() function."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.planner.perf_model import PerfModel
from pdserve.planner.policy import (
    Observation,
    PlannerPolicy,
    PlannerState,
    decide,
    desired_workers,
    load_policy,
)

ROOT = Path(__file__).resolve().parents[2]

# Prefill: 1000 tok/s per worker. A 1000-token prompt takes S = 1 s; with a 2 s TTFT target the
# M/D/1 bound allows utilisation 2 (T - S) / (2T - S) = 2/3, so one worker sustains 666.7 tok/s.
# Decode: step = 0.05 + 0.01 * batch; at the 0.25 s ITL target a worker batches 20 sequences.
PERF = PerfModel(prefill_tokens_per_s=1000.0, decode_a_s=0.05, decode_b_s=0.01)
POLICY = PlannerPolicy(name="t", ttft_target_s=2.0, itl_target_s=0.25, headroom=0.0,
                       min_prefill_workers=1, max_prefill_workers=8, min_decode_workers=1,
                       max_decode_workers=8, scale_up_cooldown_s=30.0,
                       scale_down_cooldown_s=120.0, low_water=0.6)


def obs(t: float = 100.0, rate: float = 1.5, num_prefill: int = 1, num_decode: int = 1,
        **kw) -> Observation:
    values = dict(time_s=t, request_rate=rate, mean_input_tokens=1000.0,
                  mean_output_tokens=11.0, ttft_p90_s=math.nan, itl_p90_s=math.nan,
                  queue_depth=0, kv_usage=0.0, num_prefill=num_prefill, num_decode=num_decode)
    values.update(kw)
    return Observation(**values)


# ---------------------------------------------------------------------------- the model


def test_desired_workers_by_hand():
    # prefill: 1.5 req/s x 1000 tokens = 1500 tok/s / 666.7 = 2.25 -> 3 workers.
    # decode: Little: 1.5 req/s x 10 decode tokens x 0.25 s = 3.75 sequences / 20 -> 1 worker.
    assert desired_workers(POLICY, PERF, obs()) == {"prefill": 3, "decode": 1}
    # headroom 0.2: 2.25 x 1.2 = 2.7 -> still 3; rate 2 -> 3.0 exactly -> 3, x 1.2 -> 4.
    assert desired_workers(replace(POLICY, headroom=0.2), PERF, obs())["prefill"] == 3
    assert desired_workers(POLICY, PERF, obs(rate=2.0))["prefill"] == 3
    assert desired_workers(replace(POLICY, headroom=0.2), PERF, obs(rate=2.0))["prefill"] == 4
    # decode-heavy: 2 req/s x 200 decode tokens x 0.25 s = 100 sequences / 20 = 5 workers.
    assert desired_workers(POLICY, PERF, obs(rate=2.0, mean_output_tokens=201.0))["decode"] == 5


def test_capacities_by_hand():
    assert PERF.prefill_capacity(1000, 2.0) == pytest.approx(1000 * 2 / 3)
    assert PERF.prefill_capacity(3000, 2.0) == 1000.0  # S > T: sized for throughput
    assert PERF.decode_capacity(500, 0.25) == pytest.approx(20.0)
    assert PERF.decode_capacity(500, 0.01) == 1.0  # target below one step: one sequence
    ctx = PerfModel(1000.0, 0.05, 0.0, 0.0001)  # step = 0.05 + 0.0001 * batch * context
    assert ctx.decode_capacity(1000, 0.25) == pytest.approx(2.0)
    assert PerfModel(1000.0, 0.05).decode_capacity(1000, 0.25) == math.inf


# ---------------------------------------------------------------------------- decide()


def test_scales_prefill_up_when_load_exceeds_capacity():
    decision, state = decide(POLICY, PERF, obs(), PlannerState())
    assert (decision.num_prefill, decision.num_decode) == (3, 1)
    assert "prefill 1->3" in decision.reason
    assert state.last_scale_up_s == {"prefill": 100.0}
    # the ratio follows from the two capacities: prefill-heavy load, more prefill workers
    assert decision.num_prefill > decision.num_decode


def test_scale_up_cooldown():
    _, state = decide(POLICY, PERF, obs(t=100.0), PlannerState())
    # 10 s later the load doubles (3 req/s -> 4.5 -> 5 workers): inside the 30 s cooldown
    held, state2 = decide(POLICY, PERF, obs(t=110.0, rate=3.0, num_prefill=3), state)
    assert held.num_prefill == 3 and "cooldown" in held.reason
    assert state2.last_scale_up_s["prefill"] == 100.0
    later, state3 = decide(POLICY, PERF, obs(t=130.0, rate=3.0, num_prefill=3), state2)
    assert later.num_prefill == 5
    assert state3.last_scale_up_s["prefill"] == 130.0


def test_scale_down_hysteresis_waits_for_the_cooldown():
    # 0.2 req/s needs 0.3 prefill workers -> 1; the pool has 3 (utilisation 10%).
    low = dict(rate=0.2, num_prefill=3)
    state = PlannerState()
    for t in (0.0, 60.0, 119.0):
        d, state = decide(POLICY, PERF, obs(t=t, **low), state)
        assert d.num_prefill == 3, t
    assert state.below_since_s["prefill"] == 0.0
    d, state = decide(POLICY, PERF, obs(t=120.0, **low), state)
    assert d.num_prefill == 1 and "down to 1" in d.reason
    assert state.last_scale_down_s["prefill"] == 120.0
    assert state.below_since_s["prefill"] is None


def test_a_bounce_restarts_the_scale_down_clock():
    state = PlannerState()
    _, state = decide(POLICY, PERF, obs(t=0.0, rate=0.2, num_prefill=3), state)
    _, state = decide(POLICY, PERF, obs(t=60.0, rate=1.5, num_prefill=3), state)  # needs 3
    assert state.below_since_s["prefill"] is None
    d, state = decide(POLICY, PERF, obs(t=130.0, rate=0.2, num_prefill=3), state)
    assert d.num_prefill == 3  # below only since 130
    d, _ = decide(POLICY, PERF, obs(t=250.0, rate=0.2, num_prefill=3), state)
    assert d.num_prefill == 1


def test_no_scale_down_above_low_water():
    # 1.5 req/s needs 2.25 workers: 4 -> 3 is wanted; at 4 workers utilisation is 56%.
    strict = replace(POLICY, low_water=0.5)
    state = PlannerState()
    for t in (0.0, 200.0):
        d, state = decide(strict, PERF, obs(t=t, num_prefill=4), state)
    assert d.num_prefill == 4 and "low water" in d.reason
    d, _ = decide(POLICY, PERF, obs(t=0.0, num_prefill=4), PlannerState(below_since_s={
        "prefill": -500.0}))
    assert d.num_prefill == 3  # under the default 60% low water it goes


def test_bounds():
    d, _ = decide(POLICY, PERF, obs(rate=10.0), PlannerState())  # needs 15 prefill
    assert d.num_prefill == 8
    floor = replace(POLICY, min_prefill_workers=2, min_decode_workers=2)
    d, _ = decide(floor, PERF, obs(rate=0.0), PlannerState())  # needs 0
    assert (d.num_prefill, d.num_decode) == (2, 2)
    # a pool found above its maximum comes down at once, cooldowns notwithstanding
    d, _ = decide(POLICY, PERF, obs(rate=10.0, num_prefill=12), PlannerState())
    assert d.num_prefill == 8


def test_slo_violation_reactions():
    quiet = dict(rate=0.1)  # the model alone wants 1 + 1
    d, _ = decide(POLICY, PERF, obs(**quiet, ttft_p90_s=3.0, queue_depth=2), PlannerState())
    assert d.num_prefill == 2 and "TTFT p90" in d.reason
    d, _ = decide(POLICY, PERF, obs(**quiet, ttft_p90_s=3.0, queue_depth=0), PlannerState())
    assert d.num_prefill == 1  # slow but nothing queued: more workers would not help
    d, _ = decide(POLICY, PERF, obs(**quiet, itl_p90_s=0.3, num_decode=2), PlannerState())
    assert d.num_decode == 3 and "ITL p90" in d.reason
    d, _ = decide(POLICY, PERF, obs(**quiet, kv_usage=0.95), PlannerState())
    assert d.num_decode == 2 and "KV usage" in d.reason
    d, _ = decide(POLICY, PERF, obs(**quiet), PlannerState())
    assert (d.num_prefill, d.num_decode) == (1, 1)  # nan p90s: no data, no reaction


def test_decide_is_pure():
    state = PlannerState(last_scale_up_s={"decode": 5.0}, below_since_s={"prefill": None})
    before = (dict(state.last_scale_up_s), dict(state.last_scale_down_s),
              dict(state.below_since_s))
    first = decide(POLICY, PERF, obs(), state)
    assert decide(POLICY, PERF, obs(), state) == first
    assert (state.last_scale_up_s, state.last_scale_down_s, state.below_since_s) == before


# ---------------------------------------------------------------------------- load_policy


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


def test_load_policy_values_and_defaults(tmp_path):
    p = load_policy(write(tmp_path, "ttft_target_s: 1.5\nmax_decode_workers: 4\n"))
    assert p.ttft_target_s == 1.5 and p.max_decode_workers == 4
    assert p.name == "p" and p.interval_s == PlannerPolicy().interval_s
    assert load_policy(write(tmp_path, "tpot_target_s: 0.05\n")).itl_target_s == 0.05
    assert load_policy(write(tmp_path, "")) == replace(PlannerPolicy(), name="p")


def test_deploy_policies_load():
    default = load_policy(ROOT / "deploy/policies/default.yaml")
    aggressive = load_policy(ROOT / "deploy/policies/aggressive.yaml")
    assert (default.name, aggressive.name) == ("default", "aggressive")
    assert default == replace(PlannerPolicy(), name="default")  # the file shows the defaults
    assert aggressive.scale_down_cooldown_s < default.scale_down_cooldown_s


@pytest.mark.parametrize("text, key", [
    ("ttft_targets: 1\n", "ttft_targets"),
    ("max_prefill_workers: two\n", "max_prefill_workers"),
    ("max_prefill_workers: 2.5\n", "max_prefill_workers"),
    ("min_decode_workers: true\n", "min_decode_workers"),
    ("min_prefill_workers: 4\nmax_prefill_workers: 2\n", "max_prefill_workers"),
    ("min_decode_workers: 0\n", "min_decode_workers"),
    ("interval_s: 0\n", "interval_s"),
    ("ttft_target_s: .nan\n", "ttft_target_s"),
    ("scale_down_cooldown_s: -1\n", "scale_down_cooldown_s"),
    ("low_water: 1.5\n", "low_water"),
    ("headroom: -0.1\n", "headroom"),
    ("itl_target_s: 0.1\ntpot_target_s: 0.1\n", "tpot_target_s"),
    ("name: 3\n", "name"),
    ("cost_model: guessed\n", "cost_model"),
    ("cost_model: 1\n", "cost_model"),
])
def test_load_policy_errors_name_the_key(tmp_path, text, key):
    with pytest.raises(ValueError, match=key):
        load_policy(write(tmp_path, text))


def test_load_policy_rejects_non_mappings_and_bad_yaml(tmp_path):
    with pytest.raises(ValueError, match="mapping"):
        load_policy(write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ValueError, match="YAML"):
        load_policy(write(tmp_path, "a: [1\n"))
