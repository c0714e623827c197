"""The simulator's placements (colocated chunked prefill, adaptive placement by the router's own
rule) by hand, and `pdserve plan --shapes`: the shapes, the best one with its tie rule, and the
crossovers it prints."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from pdserve.bench.metrics import SLO
from pdserve.planner import cli
from pdserve.planner.perf_model import PerfModel
from pdserve.planner.policy import PlannerPolicy
from pdserve.planner.shapes import (
    Cell,
    Shape,
    best,
    crossovers,
    shapes,
    simulate_shape,
    sweep,
)
from pdserve.planner.simulator import SimConfig, simulate
from pdserve.planner.traces import TraceRequest

# prefill 100 tokens/s anywhere; a decode step 10 ms whatever its batch
PERF = PerfModel(prefill_tokens_per_s=100.0, decode_a_s=0.01)


def fixed(prefill: int = 1, decode: int = 1) -> PlannerPolicy:
    return PlannerPolicy(name="fixed", interval_s=1000.0, min_prefill_workers=prefill,
                         max_prefill_workers=prefill, min_decode_workers=decode,
                         max_decode_workers=decode)


def times(result, i: int) -> list[float]:
    return [round(t, 9) for t in result.records[i].chunk_times]


def test_colocated_prefills_in_the_step_and_decodes_from_the_next_by_hand():
    # one step: 100 prompt tokens (1.0 s) + its fixed 10 ms -> first token at 1.01, then a
    # 10 ms step per token
    r = simulate([TraceRequest(0.0, 100, 3)], fixed(), PERF, SimConfig(placement="colocated"))
    assert times(r, 0) == pytest.approx([1.01, 1.02, 1.03])
    assert r.worker_hours["prefill"] == 0  # no prefill pool


def test_a_step_target_chunks_the_prompt_beside_the_batch_by_hand():
    # A 0.2605 s target leaves 0.2505 s beside a step's 10 ms: 25 prompt tokens a step, each
    # step 0.26 s. r0 (100 tokens) alone: 4 steps, first token at 1.04. r1 arrives at 1.01
    # and is chunked the same way beside r0's decodes: r0 gets a token every 0.26 s and r1's
    # first token comes at 1.04 + 4 * 0.26 = 2.08.
    trace = [TraceRequest(0.0, 100, 5), TraceRequest(1.01, 100, 2)]
    config = SimConfig(placement="colocated", decode_step_target_s=0.2605)
    r = simulate(trace, fixed(), PERF, config)
    assert times(r, 0) == pytest.approx([1.04, 1.30, 1.56, 1.82, 2.08])
    assert times(r, 1)[0] == pytest.approx(2.08)
    # without a target the prompt is one 1.01 s step and r0 waits that long for a token
    untimed = simulate(trace, fixed(), PERF, SimConfig(placement="colocated"))
    assert times(untimed, 0)[:3] == pytest.approx([1.01, 1.02, 2.03])


def test_adaptive_sends_the_prompt_behind_a_busy_prefill_worker_to_the_decode_worker():
    # r0: both idle, remote is sooner (1.0 s vs 1.0 s + a decode step's 10 ms). r1 at once:
    # remote would wait behind r0 (2.0 s), local takes 1.01 s -> local.
    trace = [TraceRequest(0.0, 100, 1), TraceRequest(0.0, 100, 1)]
    r = simulate(trace, fixed(), PERF, SimConfig(placement="adaptive"))
    assert times(r, 0) == pytest.approx([1.0])  # from the prefill worker
    assert times(r, 1) == pytest.approx([1.01])  # from the decode worker's own step
    fixed_rule = simulate(trace, fixed(), PERF)
    assert times(fixed_rule, 1) == pytest.approx([2.0])


def test_adaptive_keeps_a_prompt_remote_when_its_chunk_would_break_the_tpot_slo():
    # r0 decodes on the decode worker from 1.0. r1 and r2 arrive then: r1 takes the idle
    # prefill worker (1.0 s, sooner than 1.02 s beside r0); r2 would wait 2.0 s behind it, but
    # locally its 100 tokens in one step would make r0's step 1.01 s, over the 0.5 s TPOT.
    trace = [TraceRequest(0.0, 100, 50), TraceRequest(1.0, 100, 1), TraceRequest(1.0, 100, 1)]
    r = simulate(trace, fixed(), PERF, SimConfig(placement="adaptive", tpot_slo_s=0.5))
    assert max(b - a for a, b in zip(times(r, 0), times(r, 0)[1:])) < 0.5
    loose = simulate(trace, fixed(), PERF, SimConfig(placement="adaptive", tpot_slo_s=5.0))
    assert max(b - a for a, b in zip(times(loose, 0), times(loose, 0)[1:])) > 1.0


@pytest.mark.parametrize("field,value", [("placement", "both"), ("step_budget_tokens", 0),
                                         ("decode_step_target_s", 0.0), ("tpot_slo_s", -1.0)])
def test_a_bad_placement_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SimConfig(**{field: value})


def test_shapes_of_n_workers():
    assert [s.name for s in shapes(3)] == [
        "colocated x3", "disaggregated 1P:2D", "disaggregated 2P:1D", "adaptive 1P:2D",
        "adaptive 2P:1D"]
    assert [s.name for s in shapes(1)] == ["colocated x1"]
    with pytest.raises(ValueError, match="at least one worker"):
        shapes(0)


def cell(rate: float, shape: Shape, goodput: float) -> Cell:
    return Cell(rate, shape, SimpleNamespace(goodput=goodput))


COLOCATED, SPLIT, ADAPTIVE = Shape("colocated", 0, 2), Shape("disaggregated", 1, 1), Shape(
    "adaptive", 1, 1)


def test_a_later_shape_must_beat_the_simpler_by_more_than_the_tie():
    tie = [cell(1, COLOCATED, 1.0), cell(1, SPLIT, 1.019), cell(1, ADAPTIVE, 1.0)]
    assert best(tie, 1).shape == COLOCATED
    win = [cell(1, COLOCATED, 1.0), cell(1, SPLIT, 1.021), cell(1, ADAPTIVE, 1.03)]
    assert best(win, 1).shape == SPLIT  # adaptive is within 2% of the split's goodput
    with pytest.raises(ValueError, match="no shape"):
        best(win, 2)


def test_crossovers_are_where_the_best_turns_split_or_back():
    cells = [cell(1, COLOCATED, 1.0), cell(1, SPLIT, 0.9),
             cell(2, COLOCATED, 1.5), cell(2, SPLIT, 1.8),
             cell(4, COLOCATED, 1.0), cell(4, SPLIT, 1.9),
             cell(8, COLOCATED, 2.0), cell(8, SPLIT, 1.0)]
    assert [(a, b, c.shape) for a, b, c in crossovers(cells)] == [
        (1, 2, SPLIT), (4, 8, COLOCATED)]
    assert crossovers(cells[:2]) == []


def test_simulate_shape_serves_every_request_and_judges_it():
    trace = [TraceRequest(0.5 * i, 50, 4) for i in range(6)]
    slo = SLO(ttft_s=2.0, tpot_s=0.5)
    for shape in shapes(2):
        summary = simulate_shape(trace, shape, PERF, slo)
        assert summary.num_requests == 6 and summary.num_errors == 0
        assert 0 < summary.goodput <= 6 / 2.5  # the last arrives at 2.5 s


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_plan_shapes_prints_goodput_per_shape_and_the_crossover(tmp_path, capsys):
    path = tmp_path / "perf.json"
    # a decode step that grows with the batch: at 8 req/s colocated prompts stretch a 64-token
    # answer's steps past the 20 ms TPOT bound, and a split pays; at 0.5 req/s all is a tie
    perf = PerfModel(prefill_tokens_per_s=2000.0, decode_a_s=0.005, decode_b_s=0.002)
    perf.save(path)
    args = parse("plan", "--shapes", "2", "--perf", str(path), "--rates", "0.5,8",
                 "--input-len", "256", "--output-len", "64", "--slo", "ttft=300,tpot=20",
                 "--duration", "30")
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    cells = sweep(perf, 2, [0.5, 8], 30.0, 256, 64, SLO(ttft_s=0.3, tpot_s=0.02))
    assert cli.format_shapes(cells) in out
    assert best(cells, 0.5).shape == COLOCATED and best(cells, 8).shape.split
    assert "crossover between 0.5 and 8 req/s" in out


@pytest.mark.parametrize("argv,message", [
    (("--rates", "1"), "--slo"),
    (("--rates", "0,1", "--slo", "ttft=100"), "--rates"),
    (("--rates", "x", "--slo", "ttft=100"), "--rates"),
])
def test_plan_shapes_refuses_what_it_cannot_judge(tmp_path, argv, message):
    perf = tmp_path / "perf.json"
    PERF.save(perf)
    with pytest.raises(ValueError, match=message):
        cli.main(parse("plan", "--shapes", "2", "--perf", str(perf), *argv))


def test_plan_needs_policies_or_shapes(tmp_path):
    perf = tmp_path / "perf.json"
    PERF.save(perf)
    with pytest.raises(ValueError, match="--policy"):
        cli.main(parse("plan", "--perf", str(perf)))
