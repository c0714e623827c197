"""Ray placement and supervision of the workers; no routing here.

`start_ray` starts (or joins) Ray; `WorkerPool` places each prefill worker by the `prefill`
resource and each decode TP group as one STRICT_PACK placement group whose bundle 0 holds the
`decode` resource, then supervises them. Ray never restarts an actor itself (max_restarts=0):
a TP group only works whole, so the pool restarts a worker, all of its ranks, under the same
worker_id, and tells the router through `on_down` / `on_up`. Requests never go through Ray:
the router dials each worker's gRPC address (`WorkerInfo.address`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.engine.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"  # the roles, and the custom resources that place them
START_TIMEOUT_S = 600.0
PING_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
MAX_BACKOFF_S = 30.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def start_ray(address: str | None, resources: dict[str, float], num_cpus: int | None,
              tmpdir: str | None) -> None:
    """Join the Ray cluster at `address`, or (None) start a local head on 127.0.0.1 only.

    `resources` and `num_cpus` describe the local head; a joined cluster has its own.
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if tmpdir is not None:
        os.environ["RAY_TMPDIR"] = tmpdir  # its sessions, sockets and logs; read by children too
    if address is None:
        with _loopback_stays_loopback():
            ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                     resources=dict(resources), num_cpus=num_cpus)
        return
    host = address.rsplit(":", 1)[0].strip("[]")
    with _loopback_stays_loopback() if host in LOOPBACK else contextlib.nullcontext():
        ray.init(address=address)


def stop_ray() -> None:
    """Disconnect; a local head started by `start_ray` stops with it (nothing else does)."""
    ray.shutdown()


@contextlib.contextmanager
def _loopback_stays_loopback():
    # ray.init rewrites a loopback address to the host's public IP (for other nodes to reach);
    # a head bound to 127.0.0.1 is only reachable as 127.0.0.1, so keep it for this call.
    from ray._private import ray_constants

    saved, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str  # "prefill" | "decode"
    address: str  # its gRPC service (rank 0's for a decode group)
    tp_size: int = 1


@dataclass
class _Worker:
    spec: WorkerSpec
    role: str
    tp_size: int
    actors: list[Any] = field(default_factory=list)  # rank order
    pg: PlacementGroup | None = None
    info: WorkerInfo | None = None  # None until up, and while restarting


Callback = Callable[[Any], "Awaitable[None] | None"]


async def _await(ref: Any) -> Any:
    return await ref


async def _all(refs: Sequence[Any], timeout_s: float) -> list[Any]:
    """Every ref's value; raises the first failure, but only once every ref has settled."""
    gathered = asyncio.gather(*map(_await, refs), return_exceptions=True)
    # when the wait is cancelled or times out, the cancelled gather's outcome is nobody's news
    gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
    values = await asyncio.wait_for(gathered, timeout_s)
    for value in values:
        if isinstance(value, BaseException):
            raise value
    return values


async def _notify(callback: Callback, arg: Any) -> None:
    try:
        result = callback(arg)
        if inspect.isawaitable(result):
            await result
    except Exception:  # the router's problem must not stop supervision
        logger.exception("worker callback %r failed", callback)


class WorkerPool:
    """Every worker of one deployment: places, starts, supervises and stops them."""

    def __init__(
        self,
        prefill: Sequence[WorkerSpec] = (),
        decode: Sequence[WorkerSpec] = (),
        decode_tp: int | Sequence[int] = 1,
        gpus: bool = False,
        num_cpus: float | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        ping_timeout_s: float = PING_TIMEOUT_S,
    ) -> None:
        """`num_cpus` per actor (each decode rank is one); default: the spec's num_threads."""
        tps = [decode_tp] * len(decode) if isinstance(decode_tp, int) else list(decode_tp)
        if len(tps) != len(decode) or any(tp < 1 for tp in tps):
            raise ValueError(f"decode_tp must be one size >= 1 per decode worker, got {tps}")
        workers = [_Worker(s, PREFILL, 1) for s in prefill]
        workers += [_Worker(s, DECODE, tp) for s, tp in zip(decode, tps)]
        ids = Counter(w.spec.worker_id for w in workers)
        if dup := [i for i, n in ids.items() if n > 1]:
            raise ValueError(f"worker ids must be unique, repeated: {dup}")
        self._workers = {w.spec.worker_id: w for w in workers}
        self.gpus, self.num_cpus = gpus, num_cpus
        self.start_timeout_s, self.ping_timeout_s = start_timeout_s, ping_timeout_s
        self._lock = threading.Lock()  # actors / pg of every worker (restarts run in threads)
        self._closed = False
        self._classes: dict[str, Any] = {}
        self._supervision: tuple[Callback, Callback, float] | None = None
        self._watchers: dict[str, asyncio.Task] = {}

    # ---- start ----

    def start(self) -> list[WorkerInfo]:
        """Create every worker and wait until each serves; raises (stopping all) otherwise."""
        self._check_resources()
        try:
            pending = {w.spec.worker_id: self._launch(w) for w in self._workers.values()}
            self._wait(pending, time.monotonic() + self.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        return self.infos()

    def infos(self) -> list[WorkerInfo]:
        """The workers that are up now."""
        return [w.info for w in self._workers.values() if w.info is not None]

    def _cpus(self, w: _Worker) -> float:
        return self.num_cpus or w.spec.num_threads or 1

    def _bundle(self, w: _Worker, rank: int) -> dict[str, float]:
        """What one actor of the worker takes; rank 0 also takes the role's resource."""
        bundle = {"CPU": self._cpus(w)} | ({"GPU": 1} if self.gpus else {})
        return bundle | ({w.role: 1} if rank == 0 else {})

    def _check_resources(self) -> None:
        """Fail now, naming what is missing, rather than wait for resources that never come."""
        need: Counter[str] = Counter()
        for w in self._workers.values():
            need[w.role] += 1
            need["CPU"] += self._cpus(w) * w.tp_size
            need["GPU"] += w.tp_size if self.gpus else 0
        have = ray.cluster_resources()
        lacking = [f"{k}: needs {n:g}, the cluster has {have.get(k, 0):g}"
                   for k, n in sorted(need.items()) if n and have.get(k, 0) < n]
        if lacking:
            raise ValueError(
                "the Ray cluster lacks resources for this worker pool (" + "; ".join(lacking)
                + "); start nodes that carry them, e.g. `ray start --resources="
                "'{\"prefill\": 1}'` on prefill nodes and '{\"decode\": 1}' on decode nodes")
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        for w in self._workers.values():
            group = Counter()
            for rank in range(w.tp_size if w.role == DECODE else 0):
                group.update(self._bundle(w, rank))
            if group and not any(all(res.get(k, 0) >= n for k, n in group.items())
                                 for res in nodes):
                raise ValueError(f"{w.spec.worker_id}: no node of the Ray cluster holds its TP "
                                 f"group of {w.tp_size} ({dict(group)}) on its own")

    def _actor_class(self, role: str) -> Any:
        if role not in self._classes:  # imported here: the router process needs no torch
            if role == PREFILL:
                from pdserve.prefill_worker.actor import PrefillActor as cls
            else:
                from pdserve.decode_worker.actor import DecodeRankActor as cls
            self._classes[role] = ray.remote(cls)
        return self._classes[role]

    def _launch(self, w: _Worker) -> list[Any]:
        """Create the worker's actors; refs whose first value is its address once it serves."""
        opts = {"max_restarts": 0, "max_task_retries": 0, "num_cpus": self._cpus(w),
                "num_gpus": 1 if self.gpus else 0}
        cls, spec = self._actor_class(w.role), w.spec.to_dict()
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is shut down")
            if w.role == PREFILL:
                w.actors = [cls.options(resources={PREFILL: 1}, max_concurrency=2,
                                        **opts).remote(spec)]
                return [w.actors[0].address.remote()]
            if w.pg is None or placement_group_table(w.pg).get("state") in (None, "REMOVED"):
                w.pg = placement_group([self._bundle(w, r) for r in range(w.tp_size)],
                                       strategy="STRICT_PACK")
            w.actors = [
                cls.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(w.pg, r),
                    resources={DECODE: 1} if r == 0 else {}, max_concurrency=4, **opts,
                ).remote(spec, r, w.tp_size)
                for r in range(w.tp_size)
            ]
            rendezvous = w.actors[0].rendezvous.remote()
            return [a.start.remote(rendezvous) for a in w.actors]

    def _wait(self, pending: dict[str, list[Any]], deadline: float) -> None:
        owner = {ref: wid for wid, refs in pending.items() for ref in refs}
        waiting = list(owner)
        while waiting:  # one at a time, so the first failure raises at once
            done, waiting = ray.wait(waiting, timeout=max(deadline - time.monotonic(), 0))
            if not done:
                stuck = sorted({owner[ref] for ref in waiting})
                raise TimeoutError(f"workers not up within {self.start_timeout_s:g} s: "
                                   + "; ".join(self._describe(wid) for wid in stuck))
            ray.get(done)
        for wid, refs in pending.items():
            w = self._workers[wid]
            w.info = WorkerInfo(wid, w.role, ray.get(refs[0]), w.tp_size)
            logger.info("worker %s up at %s", wid, w.info.address)

    def _describe(self, worker_id: str) -> str:
        w = self._workers[worker_id]
        if w.role == PREFILL:
            return f"{worker_id} needs {self._bundle(w, 0)}"
        state = placement_group_table(w.pg).get("state") if w.pg is not None else None
        bundles = [self._bundle(w, r) for r in range(w.tp_size)]
        return f"{worker_id} needs one node for {bundles} (placement group {state})"

    # ---- supervision ----

    async def supervise(self, on_up: Callback, on_down: Callback, interval_s: float = 0.5) -> None:
        """Watch every worker (and every one `add`ed later) until cancelled: `on_down(id)`
        when one fails, then `on_up(WorkerInfo)` with its new address once its replacement
        serves."""
        self._supervision = (on_up, on_down, interval_s)
        for w in list(self._workers.values()):
            self._start_watch(w)
        try:
            await asyncio.Event().wait()
        finally:
            self._supervision = None
            watchers = list(self._watchers.values())
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            self._watchers.clear()

    def _start_watch(self, w: _Worker) -> None:
        if self._supervision is not None:
            wid = w.spec.worker_id
            self._watchers[wid] = asyncio.create_task(self._watch(w, *self._supervision),
                                                      name=f"watch-{wid}")

    # ---- scaling ----

    async def add(self, spec: WorkerSpec, role: str, tp_size: int = 1) -> WorkerInfo:
        """Start one more worker (the planner scaling up); its info once it serves."""
        if spec.worker_id in self._workers:
            raise ValueError(f"worker id {spec.worker_id!r} is already in the pool")
        w = _Worker(spec, role, tp_size)
        self._workers[spec.worker_id] = w
        try:
            refs = await asyncio.to_thread(self._launch, w)
            address, *_ = await _all(refs, self.start_timeout_s)
        except BaseException:
            del self._workers[spec.worker_id]
            await asyncio.to_thread(self._kill, w, True)
            raise
        w.info = WorkerInfo(spec.worker_id, role, address, tp_size)
        logger.info("worker %s added at %s", spec.worker_id, address)
        self._start_watch(w)
        return w.info

    async def remove(self, worker_id: str) -> None:
        """Stop a worker the router has drained (the planner scaling down)."""
        w = self._workers.pop(worker_id)
        watcher = self._watchers.pop(worker_id, None)
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        with contextlib.suppress(Exception):
            await _all([a.stop.remote() for a in w.actors], STOP_TIMEOUT_S)
        await asyncio.to_thread(self._kill, w, True)
        logger.info("worker %s removed", worker_id)

    async def _watch(self, w: _Worker, on_up: Callback, on_down: Callback,
                     interval_s: float) -> None:
        wid = w.spec.worker_id
        while not self._closed:
            await asyncio.sleep(interval_s)
            if w.info is not None and not await self._healthy(w) and not self._closed:
                w.info = None
                await _notify(on_down, wid)
                started = time.monotonic()
                if await self._restart(w):
                    logger.info("worker %s back at %s after %.1f s", wid, w.info.address,
                                time.monotonic() - started)
                    await _notify(on_up, w.info)

    async def _healthy(self, w: _Worker) -> bool:
        """Every rank answers its ping in time."""
        try:
            await _all([actor.ping.remote() for actor in w.actors], self.ping_timeout_s)
            return True
        except Exception as exc:  # RayActorError (died), RayTaskError (unhealthy), timeout
            logger.warning("worker %s is down: %s", w.spec.worker_id, repr(exc)[:500])
            return False

    async def _restart(self, w: _Worker) -> bool:
        """Replace every actor of the worker, retrying with backoff; False once shut down."""
        backoff = 1.0
        while not self._closed:
            try:
                await asyncio.to_thread(self._kill, w, False)
                refs = await asyncio.to_thread(self._launch, w)
                address, *_ = await _all(refs, self.start_timeout_s)
                w.info = WorkerInfo(w.spec.worker_id, w.role, address, w.tp_size)
                return True
            except Exception as exc:
                logger.error("restarting worker %s failed (again in %.0f s): %r",
                             w.spec.worker_id, backoff, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
        return False

    # ---- inspection and shutdown ----

    def pids(self, worker_id: str) -> list[int]:
        """The process id of each of the worker's actors, in rank order."""
        return ray.get([a.pid.remote() for a in self._workers[worker_id].actors],
                       timeout=self.ping_timeout_s)

    def node_ids(self, worker_id: str) -> list[str]:
        """The Ray node id each of the worker's actors runs on, in rank order."""
        return ray.get([a.node_id.remote() for a in self._workers[worker_id].actors],
                       timeout=self.ping_timeout_s)

    def shutdown(self) -> None:
        """Stop every actor this pool created (gracefully first) and free its groups."""
        with self._lock:
            self._closed = True
            workers = list(self._workers.values())
        # Only serving workers stop gracefully; a call to one still being created would wait.
        stops = [a.stop.remote() for w in workers if w.info is not None for a in w.actors]
        with contextlib.suppress(Exception):
            ray.wait(stops, num_returns=len(stops), timeout=STOP_TIMEOUT_S)
        for w in workers:
            self._kill(w, True)
            w.info = None

    def _kill(self, w: _Worker, remove_pg: bool) -> None:
        with self._lock:
            actors, w.actors = w.actors, []
            pg = w.pg
            if remove_pg:
                w.pg = None
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if remove_pg and pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
