"""SimFleet: the simulated workers of both pools, their lifecycle and the replica timeline.

A worker costs from the decision that adds it (`born_s`) until it stops; it serves once ready
(after the startup delay). Removing one marks it draining: it takes no new work, finishes
what it holds, then stops. A worker still starting is removed first (at once), then the
least-loaded serving one. The timeline records the pool sizes whenever they change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.planner.policy import ROLES


class ReplicaPoint(NamedTuple):
    """Pool sizes from `time_s` on (recorded when they change): targets (what the planner
    asked, workers starting included) and workers ready to serve."""

    time_s: float
    prefill: int
    decode: int
    prefill_ready: int
    decode_ready: int


@dataclass(eq=False)
class SimSeq:
    index: int  # the request's position in the trace
    context: int  # tokens in the KV cache
    remaining: int  # decode tokens still to generate


@dataclass(eq=False)
class SimWorker:
    wid: int
    role: str
    born_s: float
    ready: bool = False
    draining: bool = False
    stopped_s: float | None = None
    busy: bool = False  # prefill: serving a request; decode: a step is running
    running: list[SimSeq] = field(default_factory=list)  # decode batch
    pending: list[SimSeq] = field(default_factory=list)  # join at the next step boundary

    @property
    def active(self) -> bool:
        """Counts toward the pool's size: not draining, not stopped."""
        return not self.draining and self.stopped_s is None

    @property
    def load(self) -> int:
        return len(self.running) + len(self.pending) if self.role == "decode" else int(self.busy)


class SimFleet:
    def __init__(self) -> None:
        self.workers: list[SimWorker] = []
        self.timeline: list[ReplicaPoint] = []

    def pool(self, role: str) -> list[SimWorker]:
        return [w for w in self.workers if w.role == role and w.active]

    def add(self, role: str, now: float, ready: bool) -> SimWorker:
        w = SimWorker(len(self.workers), role, now, ready=ready)
        self.workers.append(w)
        return w

    def remove(self, role: str, now: float) -> None:
        starting = [w for w in self.pool(role) if not w.ready]
        victim = starting[-1] if starting else min(
            self.pool(role), key=lambda w: (w.load, -w.wid))
        victim.draining = True
        if not victim.ready or victim.load == 0:
            victim.stopped_s = now

    def resize(self, role: str, target: int, now: float, ready: bool) -> list[SimWorker]:
        """Add or remove workers of `role` until it has `target`; the workers added."""
        added = []
        while len(self.pool(role)) < target:
            added.append(self.add(role, now, ready))
        while len(self.pool(role)) > target:
            self.remove(role, now)
        return added

    def record_replicas(self, now: float) -> None:
        p, d = self.pool("prefill"), self.pool("decode")
        point = ReplicaPoint(now, len(p), len(d), sum(w.ready for w in p),
                             sum(w.ready for w in d))
        last = self.timeline[-1] if self.timeline else None
        if last is not None and (last.prefill, last.decode, last.prefill_ready,
                                 last.decode_ready) == point[1:]:
            return  # only changes are recorded
        if last is not None and last.time_s == now:
            self.timeline[-1] = point
        else:
            self.timeline.append(point)

    def worker_hours(self, end: float) -> dict[str, float]:
        """Per role, each worker from its decision to its stop (or `end`), starting and
        draining time included."""
        hours = {role: 0.0 for role in ROLES}
        for w in self.workers:
            stop = end if w.stopped_s is None else min(w.stopped_s, end)
            hours[w.role] += max(stop - w.born_s, 0.0) / 3600
        return hours

