"""The planner's simulator (hand-computed cases, steady vs bursty), traces, perf model, CLI and
profile() on the tiny checkpoint."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from pdserve.bench import metrics
from pdserve.bench.metrics import SLO
from pdserve.planner import cli
from pdserve.planner.evaluation import evaluate
from pdserve.planner.perf_model import PerfModel, fit_decode
from pdserve.planner.policy import PlannerPolicy
from pdserve.planner.simulator import ReplicaPoint, SimConfig, simulate
from pdserve.planner.traces import (
    TraceRequest,
    bursty_trace,
    load_trace,
    save_trace,
    steady_trace,
)


def fixed(prefill: int = 1, decode: int = 1, **kw) -> PlannerPolicy:
    return PlannerPolicy(name="fixed", min_prefill_workers=prefill, max_prefill_workers=prefill,
                         min_decode_workers=decode, max_decode_workers=decode, **kw)


def times(result, i: int) -> list[float]:
    return [round(t, 9) for t in result.records[i].chunk_times]


# ---------------------------------------------------------------------------- by hand


def test_fifo_prefill_and_step_boundaries_by_hand():
    # Prefill 100 tok/s, decode step a constant 0.5 s; one worker each.
    # prefill (FIFO): r0 100 tok 0.0-1.0 | r1 70 tok 1.0-1.7 | r2 30 tok 1.7-2.0
    # TTFT = prefill end - arrival: r0 1.0, r1 1.7, r2 2.0 - 0.2 = 1.8 (r2: one token, done)
    # decode: r0 joins at 1.0 (idle worker): steps 1.0-1.5, 1.5-2.0 (r0 alone: r1 finished its
    #   prefill at 1.7, mid-step, so it waits for the boundary at 2.0), 2.0-2.5 (r0 + r1: r0's
    #   4th token, done), 2.5-3.0 (r1's 3rd token, done).
    # r0 tokens 1.0 1.5 2.0 2.5 (TPOT 0.5); r1 tokens 1.7 2.5 3.0 (TPOT (3.0-1.7)/2 = 0.65)
    perf = PerfModel(prefill_tokens_per_s=100.0, decode_a_s=0.5)
    trace = [TraceRequest(0.0, 100, 4), TraceRequest(0.0, 70, 3), TraceRequest(0.2, 30, 1)]
    policy = fixed(interval_s=1000.0, prefill_cost_per_hour=3.6, decode_cost_per_hour=1.8)
    r = simulate(trace, policy, perf)
    assert times(r, 0) == [1.0, 1.5, 2.0, 2.5]
    assert times(r, 1) == [1.7, 2.5, 3.0]
    assert times(r, 2) == [2.0]
    assert [metrics.ttft(x) for x in r.records] == pytest.approx([1.0, 1.7, 1.8])
    assert metrics.tpot(r.records[1]) == pytest.approx(0.65)
    assert r.duration_s == pytest.approx(3.0)
    # one worker per pool for 3 s: 3 s / 3600 worker-hours each; cost 3.6/h and 1.8/h
    assert r.worker_hours == pytest.approx({"prefill": 3 / 3600, "decode": 3 / 3600})
    assert r.cost == pytest.approx(0.003 + 0.0015)
    # SLO ttft 1.6 s, tpot 0.6 s: r0 meets both; r1 misses both; r2 misses TTFT and has no
    # TPOT (one token), which meets the ITL bound.
    s = evaluate(r, SLO(ttft_s=1.6, tpot_s=0.6))
    assert (s.ttft_attainment, s.itl_attainment, s.attainment) == pytest.approx(
        (1 / 3, 2 / 3, 1 / 3))
    assert (s.prefill_range, s.decode_range) == ((1, 1), (1, 1))


def test_step_time_grows_with_batch_and_context_by_hand():
    # Prefill 1000 tok/s; step = 0.1 + 0.1 * batch + 0.001 * batch * mean context.
    # r0, r1: 100 tokens at t=0, 3 output tokens each. Prefill r0 0.0-0.1, r1 0.1-0.2.
    # step 1, [r0] context 101 (prompt + first token): 0.1 + 0.1 + 0.101 = 0.301 -> 0.401
    # step 2, [r0 ctx 102, r1 ctx 101] mean 101.5: 0.1 + 0.2 + 0.203 = 0.503 -> 0.904
    #   (r0's 3rd token: done)
    # step 3, [r1 ctx 102]: 0.1 + 0.1 + 0.102 = 0.302 -> 1.206
    perf = PerfModel(1000.0, decode_a_s=0.1, decode_b_s=0.1, decode_c_s=0.001)
    r = simulate([TraceRequest(0.0, 100, 3)] * 2, fixed(interval_s=1000.0), perf)
    assert times(r, 0) == pytest.approx([0.1, 0.401, 0.904])
    assert times(r, 1) == pytest.approx([0.2, 0.904, 1.206])


def test_new_worker_serves_after_the_startup_delay_by_hand():
    # 4 prompts of 100 tokens at t=0.5, 100 tok/s (1 s each), one token each. At the tick at
    # t=1 the planner sees 4 req/s x 100 tokens = 400 tok/s; S = 1 s = TTFT target, so a worker
    # counts for its raw 100 tok/s -> 4 wanted, max 2. The second worker serves from t=3.
    # worker 0: r0 0.5-1.5, r1 1.5-2.5, r2 2.5-3.5; worker 1 (ready at 3): r3 3.0-4.0.
    # TTFT: 1.0, 2.0, 3.0, 3.5 (alone, r3 would wait for 3.5 and finish at 4.5).
    perf = PerfModel(100.0, decode_a_s=0.1)
    policy = PlannerPolicy(interval_s=1.0, ttft_target_s=1.0, headroom=0.0,
                           max_prefill_workers=2, max_decode_workers=1)
    r = simulate([TraceRequest(0.5, 100, 1)] * 4, policy, perf, SimConfig(startup_delay_s=2.0))
    assert [metrics.ttft(x) for x in r.records] == pytest.approx([1.0, 2.0, 3.0, 3.5])
    assert r.timeline[:3] == [ReplicaPoint(0.0, 1, 1, 1, 1), ReplicaPoint(1.0, 2, 1, 1, 1),
                              ReplicaPoint(3.0, 2, 1, 2, 1)]
    # the second prefill worker costs from the decision (t=1) to the end (t=4): 3 s + 4 s
    assert r.worker_hours["prefill"] == pytest.approx(7 / 3600)
    # at t=2 nothing arrived: 1 is wanted, but not before 120 s below (hysteresis)
    assert r.decisions[1][1].num_prefill == 2


def test_a_removed_worker_drains_by_hand():
    # Two prefill workers at t=0 but the policy allows one: at the tick at t=1 both are busy
    # (w0 with r0 300 tok 0-3, w1 with r1 200 tok 0-2) and the higher id, w1, is removed. It
    # finishes r1 (TTFT 2.0) and stops; r2 (100 tok, queued) is not given to it and waits for
    # w0: 3.0-4.0, TTFT 4.0 (3.0 had w1 kept taking work).
    perf = PerfModel(100.0, decode_a_s=0.1)
    trace = [TraceRequest(0.0, 300, 1), TraceRequest(0.0, 200, 1), TraceRequest(0.0, 100, 1)]
    r = simulate(trace, fixed(interval_s=1.0), perf, SimConfig(initial_prefill=2))
    assert [metrics.ttft(x) for x in r.records] == pytest.approx([3.0, 2.0, 4.0])
    assert r.worker_hours["prefill"] == pytest.approx((4.0 + 2.0) / 3600)
    assert [pt.prefill for pt in r.timeline[:2]] == [2, 1]


# ---------------------------------------------------------------------------- steady vs bursty

# ~SmolLM2 on one CPU thread (docs/benchmarks.md): ~285 prompt tok/s, 60-130 ms decode steps.
PERF = PerfModel(prefill_tokens_per_s=285.0, decode_a_s=0.06, decode_b_s=0.002,
                 decode_c_s=0.00002)
SLO_ = SLO(ttft_s=2.0, tpot_s=0.2)
SPIKE = (200.0, 100.0)  # start, length (s)


def traces():
    steady = steady_trace(1.0, 600.0, 256, 64, seed=3)
    bursty = bursty_trace(1.0, 600.0, 256, 64, spike_factor=4.0, spike_start_s=SPIKE[0],
                          spike_len_s=SPIKE[1], seed=3)
    return steady, bursty


def test_fixed_pools_attain_less_under_a_burst():
    steady, bursty = traces()
    policy = fixed(prefill=2, decode=1, ttft_target_s=2.0, itl_target_s=0.2)
    a = evaluate(simulate(steady, policy, PERF), SLO_)
    b = evaluate(simulate(bursty, policy, PERF), SLO_)
    assert a.attainment > 0.9
    assert b.attainment < a.attainment - 0.3
    assert b.ttft_p90_s > a.ttft_p90_s


def test_autoscaling_follows_the_burst():
    _, bursty = traces()
    policy = PlannerPolicy(name="auto", ttft_target_s=2.0, itl_target_s=0.2,
                           scale_down_cooldown_s=60.0)
    result = simulate(bursty, policy, PERF, SimConfig(startup_delay_s=20.0))

    def at(role: str, t: float) -> int:  # the timeline is a step function, changes only
        return [getattr(p, role) for p in result.timeline if p.time_s <= t][-1]

    def peak(role: str, lo: float, hi: float) -> int:
        return max(at(role, t) for t in range(int(lo), int(hi)))

    start, end = SPIKE[0], SPIKE[0] + SPIKE[1]
    for role in ("prefill", "decode"):
        during = peak(role, start, end)
        assert during > peak(role, 0, start), role
        assert peak(role, end + 150, result.duration_s) < during, role
    fixed_small = evaluate(simulate(bursty, fixed(2, 1), PERF), SLO_)
    auto = evaluate(result, SLO_)
    assert auto.attainment > fixed_small.attainment + 0.3
    assert auto.prefill_range[1] > 2


def test_simulation_is_deterministic():
    _, bursty = traces()
    policy = PlannerPolicy(scale_down_cooldown_s=60.0)
    a, b = simulate(bursty, policy, PERF), simulate(bursty, policy, PERF)
    assert a.records == b.records and a.timeline == b.timeline and a.cost == b.cost


def test_simulate_rejects_bad_requests():
    with pytest.raises(ValueError, match="trace request 0"):
        simulate([TraceRequest(0.0, 0, 4)], fixed(), PERF)


# ---------------------------------------------------------------------------- traces


def test_traces_are_seeded_poisson():
    steady, bursty = traces()
    assert steady == steady_trace(1.0, 600.0, 256, 64, seed=3)
    assert steady != steady_trace(1.0, 600.0, 256, 64, seed=4)
    assert 500 < len(steady) < 700 and all(0 <= r.arrival_s < 600 for r in steady)
    arrivals = [r.arrival_s for r in bursty]
    assert arrivals == sorted(arrivals)
    in_spike = sum(SPIKE[0] <= t < SPIKE[0] + SPIKE[1] for t in arrivals)
    before = sum(t < SPIKE[0] for t in arrivals)
    assert 300 < in_spike < 500 and 150 < before < 250  # 4 x 100 s vs 1 x 200 s
    # same seed: the bursty trace equals the steady one until the spike
    assert [r for r in bursty if r.arrival_s < SPIKE[0]] == [
        r for r in steady if r.arrival_s < SPIKE[0]]


def test_trace_files(tmp_path):
    trace = [TraceRequest(0.5, 10, 2), TraceRequest(0.25, 20, 3)]
    save_trace(tmp_path / "t.json", trace)
    assert load_trace(tmp_path / "t.json") == sorted(trace)
    (tmp_path / "d.json").write_text(json.dumps(
        [{"arrival_s": 1, "input_tokens": 5, "output_tokens": 6}]))
    assert load_trace(tmp_path / "d.json") == [TraceRequest(1.0, 5, 6)]
    bench = {"settings": {}, "runs": [{"label": "x", "records": [
        {"request_id": "a", "start": 10.0, "end": 11.0, "chunk_times": [10.5, 11.0],
         "chunk_tokens": [1, 1], "num_prompt_tokens": 7}]}]}
    (tmp_path / "b.json").write_text(json.dumps(bench))
    assert load_trace(tmp_path / "b.json") == [TraceRequest(0.0, 7, 2)]
    (tmp_path / "bad.json").write_text("[[1, 2]]")
    with pytest.raises(ValueError, match="trace item 0"):
        load_trace(tmp_path / "bad.json")


# ---------------------------------------------------------------------------- perf model


def test_fit_decode_recovers_coefficients():
    a, b, c = 0.02, 0.003, 1e-5
    points = [(n, ctx, a + b * n + c * n * ctx) for n in (1, 4, 16) for ctx in (64, 512)]
    assert fit_decode(points) == pytest.approx((a, b, c), rel=1e-6)
    # a fall in step time with the batch is noise: clamped at zero, never negative
    fit = fit_decode([(1, 64, 0.010), (8, 64, 0.009), (1, 512, 0.011), (8, 512, 0.0095)])
    assert min(fit) >= 0 and fit[0] > 0


def test_perf_model_json_round_trip(tmp_path):
    perf = PerfModel(285.0, 0.06, 0.002, 2e-5, source={"model": "m", "threads": 1})
    perf.save(tmp_path / "perf.json")
    assert PerfModel.load(tmp_path / "perf.json") == perf
    (tmp_path / "bad.json").write_text('{"prefill_tokens_per_s": 1, "decode_a_s": 1, "x": 2}')
    with pytest.raises(ValueError, match="x"):
        PerfModel.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        PerfModel(0.0, 0.06)
    with pytest.raises(ValueError, match="decode_b_s"):
        PerfModel(1.0, 0.06, -1.0)


# ---------------------------------------------------------------------------- CLI, profile


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_plan_cli_compares_policies(tmp_path, capsys):
    PERF.save(tmp_path / "perf.json")
    (tmp_path / "small.yaml").write_text("max_prefill_workers: 1\nmax_decode_workers: 1\n")
    (tmp_path / "big.yaml").write_text("min_prefill_workers: 4\nmax_prefill_workers: 4\n")
    args = parse("plan", "--policy", str(tmp_path / "small.yaml"), "--policy",
                 str(tmp_path / "big.yaml"), "--trace", "bursty", "--duration", "120",
                 "--perf", str(tmp_path / "perf.json"), "--png", str(tmp_path / "plan.png"))
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "TTFT ok%" in out and "worker-h" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:4]}
    assert set(rows) == {"small", "big"}
    assert rows["big"][-2] == "4-4" and rows["small"][-2] == "1-1"
    assert float(rows["big"][3]) >= float(rows["small"][3])  # more prefill, more attained
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_profile_on_the_tiny_checkpoint(tiny_llama_dir):
    from pdserve.llm import LLM
    from pdserve.planner.profile import profile

    llm = LLM(model=str(tiny_llama_dir), num_threads=1, kv_cache_memory_bytes=1 << 26)
    perf = profile(llm, prefill_lens=(64, 256), batch_sizes=(1, 16), contexts=(32, 768),
                   decode_steps=8, source={"threads": 1})
    assert math.isfinite(perf.prefill_tokens_per_s) and perf.prefill_tokens_per_s > 0
    assert perf.decode_a_s > 0  # a step has a fixed cost; the slopes may fit to 0 (noise)
    assert all(math.isfinite(v) and v >= 0 for v in (perf.decode_b_s, perf.decode_c_s))
    points = perf.source["decode_points"]
    assert len(points) == 4 and perf.source["threads"] == 1
    # the fitted model is a model of the measurements: within 2x of every measured step
    for batch, context, measured in points:
        assert 0.5 < perf.decode_step_time(batch, context) / measured < 2.0, (points, perf)
