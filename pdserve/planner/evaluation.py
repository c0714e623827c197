"""PlanSummary: one simulated run judged against one SLO, with the same metrics as a real run
(`pdserve.bench.metrics`), plus its cost and the range of pool sizes it used."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.bench.metrics import SLO, meets, summarize
from pdserve.planner.simulator import SimResult


@dataclass(frozen=True)
class PlanSummary:
    """Attainments are fractions of all requests; the ITL criterion is per request: its TPOT,
    the mean of its gaps, within the target."""

    name: str
    num_requests: int
    ttft_attainment: float
    itl_attainment: float
    attainment: float  # both at once
    ttft_p90_s: float
    itl_p90_s: float  # over every token gap, token-weighted
    worker_hours: float
    cost: float
    prefill_range: tuple[int, int]  # (min, max) target replicas over the run
    decode_range: tuple[int, int]


def evaluate(result: SimResult, slo: SLO) -> PlanSummary:
    """Attainment and latency percentiles with `pdserve.bench.metrics`, plus cost and range."""
    records = result.records
    n = len(records)

    def attained(bound: SLO | None) -> float:
        return sum(meets(r, bound) for r in records) / n if n and bound else math.nan

    stats = summarize(records, max(result.duration_s, 1e-9), slo)
    p = [pt.prefill for pt in result.timeline]
    d = [pt.decode for pt in result.timeline]
    return PlanSummary(
        name=result.policy.name,
        num_requests=n,
        ttft_attainment=attained(SLO(ttft_s=slo.ttft_s) if slo.ttft_s else None),
        itl_attainment=attained(SLO(tpot_s=slo.tpot_s) if slo.tpot_s else None),
        attainment=attained(slo),
        ttft_p90_s=stats.ttft.p90,
        itl_p90_s=stats.itl.p90,
        worker_hours=sum(result.worker_hours.values()),
        cost=result.cost,
        prefill_range=(min(p), max(p)),
        decode_range=(min(d), max(d)),
    )
