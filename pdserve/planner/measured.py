"""The planner's performance model from what the running workers measure. Pure: no I/O.

The router places each prompt from the step-time fits its workers report (a step of p prompt
tokens and d decode tokens lasts about intercept + per_token * p + per_decode * d,
engine.step_budget.StepFit; router.placement.step_fit reads one from a load report). The
planner sizes its pools from the same fits, so the two never disagree on what a worker can do:

- a prefill worker runs full steps of its token budget B when it has a queue, so it sustains
  B / (intercept + per_token * B) prompt tokens per second (the mean over the prefill workers
  whose prompt slope is fitted);
- a decode step of `batch` sequences lasts intercept + per_decode * batch: the perf model's
  a and b, with c 0 (the fit's decode slope already holds the attention over the contexts
  it ran at) — the mean over the decode workers whose decode slope is fitted.

A side no worker has measured yet keeps the profile's numbers (`pdserve profile`'s JSON).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from statistics import fmean

from pdserve.engine.step_budget import StepFit
from pdserve.planner.perf_model import PerfModel


def measured_perf(profile: PerfModel, prefill: Sequence[tuple[StepFit, int]],
                  decode: Sequence[StepFit]) -> PerfModel:
    """`profile` with what the workers measured in its place: `prefill`, each prefill
    worker's fit (its prompt slope fitted) and token budget; `decode`, each decode worker's
    fit (its decode slope fitted). `source` says which side came from where."""
    changes: dict = {}
    rates = [budget / fit.seconds(budget) for fit, budget in prefill
             if budget > 0 and fit.seconds(budget) > 0]
    if rates:
        changes["prefill_tokens_per_s"] = fmean(rates)
    steps = [fit for fit in decode if fit.per_decode_s is not None and fit.per_decode_s > 0]
    if steps:
        changes.update(decode_a_s=fmean(f.intercept_s for f in steps),
                       decode_b_s=fmean(f.decode_s for f in steps), decode_c_s=0.0)
    source = {**profile.source, "prefill": _where(len(rates)), "decode": _where(len(steps))}
    return replace(profile, **changes, source=source)


def _where(num_measured: int) -> str:
    if not num_measured:
        return "profile"
    return f"measured by {num_measured} worker{'s' if num_measured > 1 else ''}"
