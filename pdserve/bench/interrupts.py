"""Random client cancels and router aborts mid-stream, for soaks that hunt leaks.

A real client hangs up half way through an answer, or an operator aborts it: every block and
every queue the request held must come back. `plan_interrupts` picks, over a workload's
turns, exactly round(n * cancel_fraction) to cancel and round(n * abort_fraction) to abort,
each at a random point mid-stream: after `after_tokens` output tokens, uniform in
[1, output_len - 1] (a turn asking for fewer than 2 tokens has no mid-stream and is never
picked, so with many such turns fewer than asked are). Seeded: the same arguments, the
same plan.

- cancel: the client stops reading and cancels the RPC (the router frees the request).
- abort: the client sends the router's Abort RPC for the request and reads on until the
  stream ends (finish_reason "abort").

Neither is a failure: a record says which it was (`RequestRecord.interrupted`) and the
summary counts them apart from successes and errors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from pdserve.bench.workloads import ABORT, CANCEL, BenchRequest, Interrupt


def check_fractions(cancel_fraction: float, abort_fraction: float) -> None:
    """ValueError unless both are in [0, 1] and together at most 1."""
    for name, f in (("cancel_fraction", cancel_fraction), ("abort_fraction", abort_fraction)):
        if not (math.isfinite(f) and 0 <= f <= 1):
            raise ValueError(f"{name} must be in [0, 1], got {f}")
    if cancel_fraction + abort_fraction > 1:
        raise ValueError(f"cancel_fraction + abort_fraction must be <= 1, got "
                         f"{cancel_fraction} + {abort_fraction}")


def plan_interrupts(output_lens: Sequence[int], cancel_fraction: float, abort_fraction: float,
                    seed: int) -> list[Interrupt | None]:
    """One entry per request (None: runs to its end); see the module docstring."""
    check_fractions(cancel_fraction, abort_fraction)
    n = len(output_lens)
    rng = np.random.default_rng((seed, 3))
    eligible = [i for i, length in enumerate(output_lens) if length >= 2]
    order = [eligible[j] for j in rng.permutation(len(eligible))]
    num_cancel = min(round(n * cancel_fraction), len(order))
    num_abort = min(round(n * abort_fraction), len(order) - num_cancel)
    plan: list[Interrupt | None] = [None] * n
    for rank, i in enumerate(order[:num_cancel + num_abort]):
        kind = CANCEL if rank < num_cancel else ABORT
        plan[i] = Interrupt(kind, int(rng.integers(1, output_lens[i])))
    return plan


def with_interrupts(jobs: Sequence[Sequence[BenchRequest]], cancel_fraction: float,
                    abort_fraction: float, seed: int) -> list[list[BenchRequest]]:
    """The jobs with a planned interrupt on some turns (over all turns of all jobs)."""
    turns = [t for job in jobs for t in job]
    plan = iter(plan_interrupts([t.output_len for t in turns], cancel_fraction,
                                abort_fraction, seed))
    return [[replace(t, interrupt=next(plan)) for t in job] for job in jobs]
