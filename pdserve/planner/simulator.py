"""A deterministic discrete-event simulation of the disaggregated service, planner in the loop.

Model (times from a `PerfModel`; no randomness here — traces carry it, seeded):

- **Prefill**: one FIFO queue in front of the prefill pool (the router's queue); an idle
  worker takes the head and serves it in input_tokens / prefill_tokens_per_s seconds. The
  first token comes out of prefill: TTFT = prefill end - arrival.
- **Decode**: the request (if it wants more than one token) joins the least-loaded decode
  worker (fewest sequences, then lowest id) and enters its batch at the next step boundary (at
  once if the worker is idle). A step advances every sequence in the batch by one token and
  takes `decode_step_time(batch, mean context)`; all tokens of a step arrive at its end.
  KV transfer is instantaneous and KV capacity unbounded (`kv_capacity_tokens` only feeds the
  observed `kv_usage`).
- **Where prompts are prefilled** (`SimConfig.placement`): "disaggregated", on the prefill
  pool as above; "colocated", no prefill pool: every prompt goes to the decode worker with the
  fewest sequences and queued prompt tokens, which prefills it in chunks inside its steps;
  "adaptive", per request as the router decides (router.disaggregation.decide, on the lines
  this model implies). A decode step that carries `chunk` prompt tokens beside `batch`
  decodes takes `decode_step_time(batch, context) + chunk / prefill_tokens_per_s` (`decode_a_s`
  when nobody decodes); its chunk is what fits `step_budget_tokens` beside the decodes, or
  with `decode_step_target_s` what keeps the step about that long (at least one token). A
  prompt's first token comes at the end of the step that computes its last chunk, and it
  decodes from the next step on.
- **Planner**: every `interval_s` (at t = interval, 2 interval, ...) `decide` gets an
  `Observation` of the last interval: arrivals (rate, mean lengths), p90 of the TTFTs and ITL
  gaps that occurred in it, the prefill queue, decode KV usage and the worker counts (workers
  still starting included). New workers serve after `startup_delay_s` but cost from the
  decision on; removed workers take no new work, finish what they hold, then stop (a worker
  still starting is cancelled first, then the least-loaded ones drain).
- Events at one instant run in this order: worker ready, prefill done, decode step done,
  arrival, planner tick (then in the order they were scheduled).

Why one file: one event loop owns every worker's state and every event's effect on it; split,
an event's handling would cross modules.

Outputs: one `RequestRecord` per request (pdserve.bench.trace, one token per chunk), so
`pdserve.bench.metrics` computes TTFT / ITL / TPOT and SLO attainment exactly as for a real
run (`evaluation.evaluate`); replica counts over time (the pool sizes, recorded whenever they
change); worker-hours and cost per pool (a worker costs from the decision that adds it,
`born_s`, until it stops). The run ends when the last request finishes.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.bench.metrics import percentile
from pdserve.bench.trace import RequestRecord
from pdserve.engine.step_budget import StepFit
from pdserve.planner.perf_model import PerfModel
from pdserve.planner.policy import (
    ROLES,
    Decision,
    Observation,
    PlannerPolicy,
    PlannerState,
    decide,
)
from pdserve.planner.traces import TraceRequest
from pdserve.router import disaggregation

logger = logging.getLogger(__name__)

_READY, _PREFILL_DONE, _STEP_DONE, _ARRIVAL, _TICK = range(5)
PLACEMENTS = ("disaggregated", "colocated", "adaptive")


@dataclass(frozen=True)
class SimConfig:
    startup_delay_s: float = 30.0  # a new worker serves this long after the decision
    initial_prefill: int | None = None  # workers ready at t = 0 (None: the policy's minimum)
    initial_decode: int | None = None
    kv_capacity_tokens: int | None = None  # per decode worker; None reports kv_usage 0
    placement: str = "disaggregated"  # where prompts are prefilled (the module doc)
    step_budget_tokens: int = 2048  # a decode step's tokens: decodes plus a prompt chunk
    decode_step_target_s: float | None = None  # a step with a chunk lasts about this long
    tpot_slo_s: float | None = None  # what adaptive placement keeps decode batches within

    def __post_init__(self) -> None:
        if not (math.isfinite(self.startup_delay_s) and self.startup_delay_s >= 0):
            raise ValueError(f"startup_delay_s must be >= 0, got {self.startup_delay_s}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.step_budget_tokens < 1:
            raise ValueError(f"step_budget_tokens must be >= 1, got {self.step_budget_tokens}")
        for name in ("decode_step_target_s", "tpot_slo_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be > 0 seconds (or None), got {v}")
        for name in ("initial_prefill", "initial_decode", "kv_capacity_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 (or None), got {v}")


class ReplicaPoint(NamedTuple):
    """Pool sizes from `time_s` on (recorded when they change): targets (what the planner
    asked, workers starting included) and workers ready to serve."""

    time_s: float
    prefill: int
    decode: int
    prefill_ready: int
    decode_ready: int


@dataclass(frozen=True)
class SimResult:
    policy: PlannerPolicy
    records: list[RequestRecord]
    timeline: list[ReplicaPoint]
    decisions: list[tuple[Observation, Decision]]
    duration_s: float  # t = 0 to the last request's finish
    worker_hours: dict[str, float]  # per role, starting and draining time included
    cost: float


@dataclass(eq=False)
class _Seq:
    index: int  # the request's position in the trace
    context: int  # tokens in the KV cache
    remaining: int  # decode tokens still to generate


@dataclass(eq=False)
class _Worker:
    wid: int
    role: str
    born_s: float
    ready: bool = False
    draining: bool = False
    stopped_s: float | None = None
    busy: bool = False  # prefill: serving a request; decode: a step is running
    busy_until: float = 0.0  # prefill: when the request it serves is done
    running: list[_Seq] = field(default_factory=list)  # decode batch
    pending: list[_Seq] = field(default_factory=list)  # join at the next step boundary
    prompts: deque[list[int]] = field(default_factory=deque)  # [index, tokens left] to prefill
    chunks: list[tuple[list[int], int]] = field(default_factory=list)  # the step's prompt part

    @property
    def active(self) -> bool:
        """Counts toward the pool's size: not draining, not stopped."""
        return not self.draining and self.stopped_s is None

    @property
    def load(self) -> int:
        return len(self.running) + len(self.pending) if self.role == "decode" else int(self.busy)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens queued here for a local prefill."""
        return sum(left for _, left in self.prompts)


class _Fleet:
    """The simulated workers of both pools, their lifecycle (the module docstring's **Planner**
    bullet) and the replica timeline."""

    def __init__(self) -> None:
        self.workers: list[_Worker] = []
        self.timeline: list[ReplicaPoint] = []

    def pool(self, role: str) -> list[_Worker]:
        return [w for w in self.workers if w.role == role and w.active]

    def add(self, role: str, now: float, ready: bool) -> _Worker:
        w = _Worker(len(self.workers), role, now, ready=ready)
        self.workers.append(w)
        return w

    def remove(self, role: str, now: float) -> None:
        starting = [w for w in self.pool(role) if not w.ready]
        victim = starting[-1] if starting else min(
            self.pool(role), key=lambda w: (w.load, -w.wid))
        victim.draining = True
        if not victim.ready or victim.load == 0:
            victim.stopped_s = now

    def resize(self, role: str, target: int, now: float, ready: bool) -> list[_Worker]:
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


class _Simulation:
    """Mutable simulation state; owned by `simulate` for one run."""

    def __init__(self, trace: Sequence[TraceRequest], policy: PlannerPolicy, perf: PerfModel,
                 config: SimConfig) -> None:
        self.trace, self.policy, self.perf, self.config = list(trace), policy, perf, config
        self.events: list[tuple[float, int, int, object]] = []
        self.counter = itertools.count()
        self.fleet = _Fleet()
        self.queue: deque[int] = deque()
        self.token_times: list[list[float]] = [[] for _ in self.trace]
        self.num_done = 0
        self.state = PlannerState()
        self.decisions: list[tuple[Observation, Decision]] = []
        self.window_arrivals: list[int] = []
        self.window_ttfts: list[float] = []
        self.window_itls: list[float] = []
        self.now = 0.0

    def push(self, time: float, kind: int, payload: object = None) -> None:
        heapq.heappush(self.events, (time, kind, next(self.counter), payload))

    # -- workers ------------------------------------------------------------------------------

    def resize(self, role: str, target: int) -> None:
        if role == "prefill" and self.config.placement == "colocated":
            return  # no prefill pool
        delay = self.config.startup_delay_s
        for w in self.fleet.resize(role, target, self.now, ready=delay == 0):
            if not w.ready:
                self.push(self.now + delay, _READY, w)

    # -- prefill ------------------------------------------------------------------------------

    def dispatch_prefill(self) -> None:
        for w in self.fleet.pool("prefill"):
            if not self.queue:
                return
            if w.ready and not w.busy:
                i = self.queue.popleft()
                w.busy = True
                w.busy_until = self.now + self.perf.prefill_time(self.trace[i].input_tokens)
                self.push(w.busy_until, _PREFILL_DONE, (w, i))

    def prefill_done(self, w: _Worker, i: int) -> None:
        w.busy = False
        if w.draining:
            w.stopped_s = self.now
        req = self.trace[i]
        self.token_times[i].append(self.now)
        self.window_ttfts.append(self.now - req.arrival_s)
        if req.output_tokens <= 1:
            self.num_done += 1
        else:
            target = min(self.ready_decode(), key=lambda d: (d.load, d.wid))
            target.pending.append(_Seq(i, req.input_tokens + 1, req.output_tokens - 1))
            if not target.busy:
                self.start_step(target)
        self.dispatch_prefill()

    # -- where a prompt is prefilled ----------------------------------------------------------

    def ready_decode(self) -> list[_Worker]:
        ready = [d for d in self.fleet.pool("decode") if d.ready]
        assert ready, "the decode pool always keeps a ready worker"
        return ready

    def arrive(self, i: int) -> None:
        placement = self.config.placement
        if placement == "disaggregated":
            self.queue.append(i)
            self.dispatch_prefill()
            return
        local = min(self.ready_decode(), key=lambda d: (d.load, d.prompt_tokens, d.wid))
        if placement == "adaptive" and self.decide(i, local).where == disaggregation.REMOTE:
            self.queue.append(i)
            self.dispatch_prefill()
            return
        local.prompts.append([i, self.trace[i].input_tokens])
        if not local.busy:
            self.start_step(local)

    def decide(self, i: int, local: _Worker) -> disaggregation.Decision:
        """The router's rule on this request, from the fits the perf model implies: a prompt
        token costs 1 / prefill_tokens_per_s anywhere, a decode worker's step `decode_a_s`
        more and each of its decodes b + c * its batch's mean context; the prefill pool's
        queue is shared out over its ready workers."""
        per_token = 1.0 / self.perf.prefill_tokens_per_s
        pool = [w for w in self.fleet.pool("prefill") if w.ready]
        queued = sum(self.trace[j].input_tokens for j in self.queue) + sum(
            max(w.busy_until - self.now, 0.0) * self.perf.prefill_tokens_per_s
            for w in pool if w.busy)
        tokens = self.trace[i].input_tokens
        remote = disaggregation.Option("prefill", round(queued / max(len(pool), 1)), tokens,
                                       StepFit(0.0, per_token), 1 << 30)
        batch = local.running + local.pending
        context = sum(s.context for s in batch) / len(batch) if batch else tokens
        per_decode = self.perf.decode_b_s + self.perf.decode_c_s * context
        near = disaggregation.Option(
            f"decode-{local.wid}", local.prompt_tokens, tokens,
            StepFit(self.perf.decode_a_s, per_token, per_decode),
            self.chunk_budget(local) + local.load, num_decoding=local.load)
        return disaggregation.decide(remote, near, False, self.config.tpot_slo_s)

    # -- decode -------------------------------------------------------------------------------

    def chunk_budget(self, w: _Worker) -> int:
        """Prompt tokens `w`'s next step may take beside its decodes (at least one)."""
        batch = len(w.running) + len(w.pending)
        budget = self.config.step_budget_tokens - batch
        target = self.config.decode_step_target_s
        if target is not None:
            left = target - self.decode_s(w.running + w.pending)
            budget = min(budget, math.floor(left * self.perf.prefill_tokens_per_s))
        return max(budget, 1)

    def decode_s(self, batch: list[_Seq]) -> float:
        """A step's decode part (its fixed cost alone when nobody decodes)."""
        if not batch:
            return self.perf.decode_a_s
        context = sum(s.context for s in batch) / len(batch)
        return self.perf.decode_step_time(len(batch), context)

    def start_step(self, w: _Worker) -> None:
        budget = self.chunk_budget(w)
        w.running.extend(w.pending)
        w.pending.clear()
        w.chunks = []
        for entry in w.prompts:
            if budget <= 0:
                break
            take = min(entry[1], budget)
            w.chunks.append((entry, take))
            budget -= take
        if not w.running and not w.chunks:
            w.busy = False
            if w.draining:
                w.stopped_s = self.now
            return
        w.busy = True
        chunk = sum(n for _, n in w.chunks)
        seconds = self.decode_s(w.running) + chunk / self.perf.prefill_tokens_per_s
        self.push(self.now + seconds, _STEP_DONE, w)

    def step_done(self, w: _Worker) -> None:
        still = []
        for s in w.running:
            times = self.token_times[s.index]
            self.window_itls.append(self.now - times[-1])
            times.append(self.now)
            s.context += 1
            s.remaining -= 1
            if s.remaining > 0:
                still.append(s)
            else:
                self.num_done += 1
        w.running = still
        for entry, n in w.chunks:  # a prompt whose last chunk ran: its first token
            entry[1] -= n
            if entry[1] == 0:
                w.prompts.remove(entry)
                i, req = entry[0], self.trace[entry[0]]
                self.token_times[i].append(self.now)
                self.window_ttfts.append(self.now - req.arrival_s)
                if req.output_tokens <= 1:
                    self.num_done += 1
                else:
                    w.pending.append(_Seq(i, req.input_tokens + 1, req.output_tokens - 1))
        self.start_step(w)

    # -- planner ------------------------------------------------------------------------------

    def observe(self) -> Observation:
        interval = self.policy.interval_s
        arrived = [self.trace[i] for i in self.window_arrivals]
        n = len(arrived)
        decode = [w for w in self.fleet.pool("decode") if w.ready]
        cap = self.config.kv_capacity_tokens
        kv = 0.0
        if cap and decode:
            kv = sum(sum(s.context for s in w.running + w.pending) for w in decode) / (
                cap * len(decode))
        return Observation(
            time_s=self.now,
            request_rate=n / interval,
            mean_input_tokens=sum(r.input_tokens for r in arrived) / n if n else 0.0,
            mean_output_tokens=sum(r.output_tokens for r in arrived) / n if n else 0.0,
            ttft_p90_s=percentile(self.window_ttfts, 90),
            itl_p90_s=percentile(self.window_itls, 90),
            queue_depth=len(self.queue),
            kv_usage=kv,
            num_prefill=len(self.fleet.pool("prefill")),
            num_decode=len(self.fleet.pool("decode")),
        )

    def tick(self) -> None:
        obs = self.observe()
        decision, self.state = decide(self.policy, self.perf, obs, self.state)
        self.decisions.append((obs, decision))
        self.window_arrivals, self.window_ttfts, self.window_itls = [], [], []
        self.resize("prefill", decision.num_prefill)
        self.resize("decode", decision.num_decode)
        self.fleet.record_replicas(self.now)
        self.dispatch_prefill()
        self.push(self.now + self.policy.interval_s, _TICK)

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> SimResult:
        p_lo, d_lo = self.policy.bounds("prefill")[0], self.policy.bounds("decode")[0]
        colocated = self.config.placement == "colocated"
        for role, n in (("prefill", 0 if colocated else self.config.initial_prefill or p_lo),
                        ("decode", self.config.initial_decode or d_lo)):
            for _ in range(n):
                self.fleet.add(role, self.now, ready=True)
        self.fleet.record_replicas(self.now)
        for i, req in enumerate(self.trace):
            self.push(req.arrival_s, _ARRIVAL, i)
        self.push(self.policy.interval_s, _TICK)
        while self.num_done < len(self.trace):
            self.now, kind, _, payload = heapq.heappop(self.events)
            self.handle(kind, payload)
        return self.result()

    def handle(self, kind: int, payload: object) -> None:
        if kind == _ARRIVAL:
            self.window_arrivals.append(payload)  # type: ignore[arg-type]
            self.arrive(payload)  # type: ignore[arg-type]
        elif kind == _PREFILL_DONE:
            self.prefill_done(*payload)  # type: ignore[misc]
        elif kind == _STEP_DONE:
            self.step_done(payload)  # type: ignore[arg-type]
        elif kind == _READY:
            w: _Worker = payload  # type: ignore[assignment]
            if w.stopped_s is None:
                w.ready = True
                self.fleet.record_replicas(self.now)
                self.dispatch_prefill()
        else:
            self.tick()

    def result(self) -> SimResult:
        end = max((t[-1] for t in self.token_times if t), default=0.0)
        hours = self.fleet.worker_hours(end)
        cost = sum(hours[r] * self.policy.cost_per_hour(r) for r in ROLES)
        records = [
            RequestRecord(request_id=f"r{i}", start=req.arrival_s, end=times[-1],
                          chunk_times=tuple(times), chunk_tokens=(1,) * len(times),
                          num_prompt_tokens=req.input_tokens)
            for i, (req, times) in enumerate(zip(self.trace, self.token_times))
        ]
        return SimResult(self.policy, records, self.fleet.timeline, self.decisions, end, hours,
                         cost)

def simulate(
    trace: Sequence[TraceRequest], policy: PlannerPolicy, perf: PerfModel,
    config: SimConfig | None = None,
) -> SimResult:
    """Serve `trace` with the pools `policy` plans; see the module docstring for the model."""
    for i, req in enumerate(trace):
        if req.input_tokens < 1 or req.output_tokens < 1 or not req.arrival_s >= 0:
            raise ValueError(f"trace request {i}: need arrival_s >= 0 and >= 1 input and output "
                             f"tokens, got {tuple(req)}")
    ordered = sorted(trace, key=lambda r: r.arrival_s)
    result = _Simulation(ordered, policy, perf, config or SimConfig()).run()
    logger.info("simulated %d requests over %.0fs with policy %r", len(ordered),
                result.duration_s, policy.name)
    return result
