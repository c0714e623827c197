"""Deployment shapes compared in simulation: N workers colocated (each prefills and decodes its
own requests), or split P:D with every prompt on the prefill pool (disaggregated) or each one
placed by the router's own rule (adaptive, router.disaggregation). For each offered load the
goodput of every shape at an SLO, the best one, and the loads where the best changes from a
colocated to a split shape or back: `pdserve plan --shapes N` prints them.

The simulator runs each shape on the same seeded Poisson trace with the perf model of
`pdserve profile`, and decode steps that prefill sized as the service sizes them: to half
the TPOT bound when the SLO has one (pdserve.launch.service), else to the token budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.bench import metrics
from pdserve.bench.metrics import SLO
from pdserve.planner.perf_model import PerfModel
from pdserve.planner.policy import PlannerPolicy
from pdserve.planner.simulator import SimConfig, simulate
from pdserve.planner.traces import TraceRequest, steady_trace

NEVER_S = 1e12  # the planner's interval: a shape's pools stay as they are
TIE = 0.02  # goodputs within 2% of each other are a tie (`best`)


@dataclass(frozen=True)
class Shape:
    placement: str  # colocated | disaggregated | adaptive (SimConfig.placement)
    num_prefill: int  # 0 when colocated
    num_decode: int

    @property
    def name(self) -> str:
        if self.placement == "colocated":
            return f"colocated x{self.num_decode}"
        return f"{self.placement} {self.num_prefill}P:{self.num_decode}D"

    @property
    def split(self) -> bool:
        return self.placement != "colocated"


def shapes(num_workers: int) -> list[Shape]:
    """Colocated on all of them, then every P:D split, fixed and adaptive."""
    if num_workers < 1:
        raise ValueError(f"shapes need at least one worker, got {num_workers}")
    splits = [(p, num_workers - p) for p in range(1, num_workers)]
    return [Shape("colocated", 0, num_workers),
            *(Shape("disaggregated", p, d) for p, d in splits),
            *(Shape("adaptive", p, d) for p, d in splits)]


@dataclass(frozen=True)
class Cell:
    rate: float  # offered requests/s
    shape: Shape
    summary: metrics.Summary


def simulate_shape(trace: Sequence[TraceRequest], shape: Shape, perf: PerfModel, slo: SLO,
                   step_budget_tokens: int = 2048) -> metrics.Summary:
    """`trace` served by `shape` (pools fixed), judged against `slo`."""
    # the planner never ticks (NEVER_S): its targets are unused, and a colocated shape's
    # prefill pool is never started (a policy keeps at least one in its bounds)
    policy = PlannerPolicy(
        name=shape.name, interval_s=NEVER_S, ttft_target_s=slo.ttft_s or 1.0,
        itl_target_s=slo.tpot_s or 1.0, min_prefill_workers=max(shape.num_prefill, 1),
        max_prefill_workers=max(shape.num_prefill, 1), min_decode_workers=shape.num_decode,
        max_decode_workers=shape.num_decode)
    config = SimConfig(startup_delay_s=0.0, placement=shape.placement,
                       step_budget_tokens=step_budget_tokens,
                       decode_step_target_s=slo.tpot_s / 2 if slo.tpot_s else None,
                       tpot_slo_s=slo.tpot_s)
    result = simulate(trace, policy, perf, config)
    return metrics.summarize(result.records, max(result.duration_s, 1e-9), slo)


def sweep(perf: PerfModel, num_workers: int, rates: Sequence[float], duration_s: float,
          input_len: int, output_len: int, slo: SLO, seed: int = 0) -> list[Cell]:
    """Every shape of `num_workers` at every offered rate (a seeded Poisson trace each)."""
    cells = []
    for rate in rates:
        trace = steady_trace(rate, duration_s, input_len, output_len, seed)
        if not trace:
            raise ValueError(f"no request arrives in {duration_s:g} s at {rate:g} req/s")
        cells += [Cell(rate, shape, simulate_shape(trace, shape, perf, slo))
                  for shape in shapes(num_workers)]
    return cells


def best(cells: Sequence[Cell], rate: float) -> Cell:
    """The shape with the highest goodput at `rate`. Shapes are taken in `shapes`' order
    (colocated, the fewest prefill workers, fixed before adaptive: the simplest first), and a
    later one wins only by more than `TIE` of the goodput: at a light load every shape serves
    everything, and which finished its last request a millisecond sooner is no reason to
    deploy it."""
    top = None
    for cell in (c for c in cells if c.rate == rate):
        if top is None or (cell.summary.goodput or 0.0) > (top.summary.goodput or 0.0) * (1 + TIE):
            top = cell
    if top is None:
        raise ValueError(f"no shape was simulated at {rate:g} req/s")
    return top


def crossovers(cells: Sequence[Cell]) -> list[tuple[float, float, Cell]]:
    """Where the best shape turns from colocated to split or back, ascending: (the last rate
    swept before, the first after, the new best there)."""
    changes, last = [], None
    for rate in sorted({c.rate for c in cells}):
        top = best(cells, rate)
        if last is not None and top.shape.split != last[1].shape.split:
            changes.append((last[0], rate, top))
        last = (rate, top)
    return changes
