"""WorkerPool: every worker of one deployment, placed on Ray, started, scaled and stopped.

Each worker is a `Worker` (its actors and placement group); the pool checks that the
cluster can hold them all, starts them, adds and removes workers at run time (the planner),
and hands supervision to a `Supervisor`, which tells the router through `on_down` /
`on_up`. Requests never go through Ray: the router dials each worker's gRPC address
(`WorkerInfo.address`). Every worker gets the cluster secret through its environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import ray

from pdserve.cluster_secret import ClusterSecret
from pdserve.launch.supervisor import Callback, Supervisor
from pdserve.launch.worker import (
    DECODE,
    PREFILL,
    Worker,
    WorkerInfo,
    deployment_launches,
    gather_refs,
    retire,
)
from pdserve.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
PING_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


def fits_apart(bundles: Sequence[Counter[str]], nodes: Sequence[dict[str, float]]) -> bool:
    """Whether each bundle fits a node of its own: the first (rank 0's, with the role's
    resource) on one node, the others, alike, on as many other nodes."""
    def holds(res: dict[str, float], bundle: Counter[str]) -> bool:
        return all(res.get(k, 0) >= n for k, n in bundle.items())

    first, rest = bundles[0], bundles[1:]
    return any(holds(home, first) and sum(
        holds(res, rest[0]) for j, res in enumerate(nodes) if j != i) >= len(rest)
        for i, home in enumerate(nodes)) if rest else any(holds(res, first) for res in nodes)


class WorkerPool:
    """Every worker of one deployment: places, starts, supervises, scales and stops them."""

    def __init__(
        self,
        prefill: Sequence[WorkerSpec] = (),
        decode: Sequence[WorkerSpec] = (),
        decode_tp: int | Sequence[int] = 1,
        gpus: bool = False,
        num_cpus: float | None = None,
        tp_placement: str = "STRICT_PACK",
        deployment: str | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        ping_timeout_s: float = PING_TIMEOUT_S,
        *,
        secret: ClusterSecret,
        redis_password: str | None = None,
    ) -> None:
        """`num_cpus` per actor (each decode rank is one); default: the spec's num_threads.
        `secret` authenticates the worker plane; each actor gets it, and the Redis password its
        prefix events need, in its runtime_env. `deployment` names the workers detached from
        this process (`Worker`): `start` adopts the ones an earlier owner of that deployment
        left running."""
        if not isinstance(secret, ClusterSecret):
            raise ValueError("WorkerPool needs secret=ClusterSecret (ClusterSecret.generate() "
                             "or ClusterSecret.from_env())")
        self.secret, self.redis_password = secret, redis_password
        tps = [decode_tp] * len(decode) if isinstance(decode_tp, int) else list(decode_tp)
        if len(tps) != len(decode) or any(tp < 1 for tp in tps):
            raise ValueError(f"decode_tp must be one size >= 1 per decode worker, got {tps}")
        self.gpus, self.num_cpus, self.tp_placement = gpus, num_cpus, tp_placement
        if deployment is not None and (not deployment or "/" in deployment):
            raise ValueError(f"deployment must be a name without '/', got {deployment!r}")
        self.deployment = deployment
        self.start_timeout_s, self.ping_timeout_s = start_timeout_s, ping_timeout_s
        workers = [self._worker(s, PREFILL, 1) for s in prefill]
        workers += [self._worker(s, DECODE, tp) for s, tp in zip(decode, tps)]
        ids = Counter(w.worker_id for w in workers)
        if dup := [i for i, n in ids.items() if n > 1]:
            raise ValueError(f"worker ids must be unique, repeated: {dup}")
        self._workers = {w.worker_id: w for w in workers}
        self._lock = threading.Lock()  # the table and closed: shutdown runs in another thread
        self._closed = False
        self._supervisor: Supervisor | None = None

    def _worker(self, spec: WorkerSpec, role: str, tp_size: int) -> Worker:
        return Worker(spec, role, tp_size, self.num_cpus or spec.num_threads or 1, self.gpus,
                      secret=self.secret, redis_password=self.redis_password,
                      tp_placement=self.tp_placement, deployment=self.deployment)

    # ---- start ----

    def start(self) -> list[WorkerInfo]:
        """Create every worker and wait until each serves; raises (stopping all) otherwise."""
        self._check_resources()
        try:
            adopted = self._adopt() if self.deployment else set()
            pending = {wid: w.launch() for wid, w in self._workers.items() if wid not in adopted}
            self._wait(pending, time.monotonic() + self.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        return self.infos()

    def _adopt(self) -> set[str]:
        """The workers an earlier owner of the deployment left serving, taken over (`Worker.
        adopt`); what else of the deployment it left (the planner's workers, say: nobody
        would supervise them) stopped. The ids of those taken over."""
        found = deployment_launches(self.deployment)
        adopted = {wid for wid, w in self._workers.items()
                   if w.adopt(found.pop(wid, {}), self.ping_timeout_s)}
        for wid in sorted(adopted):
            logger.info("worker %s adopted at %s", wid, self._workers[wid].info.address)
        for wid, launches in sorted(found.items()):
            retire(f"{self.deployment}/{wid}", launches)
            logger.info("worker %s, left by an earlier owner, stopped", wid)
        return adopted

    def infos(self) -> list[WorkerInfo]:
        """The workers that are up now."""
        return [w.info for w in self._workers.values() if w.info is not None]

    def _check_resources(self) -> None:
        """Fail now, naming what is missing, rather than wait for resources that never come."""
        need: Counter[str] = Counter()
        for w in self._workers.values():
            need[w.role] += 1
            need["CPU"] += w.cpus * w.tp_size
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
            bundles = w.node_bundles()
            if bundles and not fits_apart(bundles, nodes):
                where = ("on one node" if len(bundles) == 1 else
                         f"on {len(bundles)} nodes, one rank each")
                raise ValueError(
                    f"{w.worker_id}: the Ray cluster has no room for its TP group of "
                    f"{w.tp_size} {where} ({[dict(b) for b in bundles]}, {w.tp_placement}); "
                    "add nodes, or let ranks cross nodes (--decode-tp-placement PACK)")

    def _wait(self, pending: dict[str, list[Any]], deadline: float) -> None:
        owner = {ref: wid for wid, refs in pending.items() for ref in refs}
        waiting = list(owner)
        while waiting:  # one at a time, so the first failure raises at once
            done, waiting = ray.wait(waiting, timeout=max(deadline - time.monotonic(), 0))
            if not done:
                stuck = sorted({owner[ref] for ref in waiting})
                raise TimeoutError(f"workers not up within {self.start_timeout_s:g} s: "
                                   + "; ".join(self._workers[wid].describe() for wid in stuck))
            ray.get(done)
        for wid, refs in pending.items():
            info = self._workers[wid].serving(ray.get(refs[0]))
            logger.info("worker %s up at %s", wid, info.address)

    # ---- supervision ----

    async def supervise(self, on_up: Callback, on_down: Callback, interval_s: float = 0.5) -> None:
        """Watch every worker (and every one `add`ed later) until cancelled: `on_down(id)`
        when one fails, then `on_up(WorkerInfo)` with its new address once its replacement
        serves."""
        supervisor = Supervisor(on_up, on_down, interval_s, self.ping_timeout_s,
                                self.start_timeout_s)
        self._supervisor = supervisor
        for w in list(self._workers.values()):
            supervisor.watch(w)
        try:
            await asyncio.Event().wait()
        finally:
            self._supervisor = None
            await supervisor.close()

    # ---- scaling ----

    async def add(self, spec: WorkerSpec, role: str, tp_size: int = 1) -> WorkerInfo:
        """Start one more worker (the planner scaling up); its info once it serves."""
        w = self._worker(spec, role, tp_size)
        with self._lock:  # after shutdown's snapshot of the table, a new worker would leak
            if self._closed:
                raise RuntimeError("the worker pool is shut down")
            if spec.worker_id in self._workers:
                raise ValueError(f"worker id {spec.worker_id!r} is already in the pool")
            self._workers[spec.worker_id] = w
        try:
            info = await w.start(self.start_timeout_s)
        except BaseException:
            del self._workers[spec.worker_id]
            await asyncio.to_thread(w.kill, True)
            raise
        logger.info("worker %s added at %s", spec.worker_id, info.address)
        if self._supervisor is not None:
            self._supervisor.watch(w)
        return info

    async def remove(self, worker_id: str) -> None:
        """Stop a worker the router has drained (the planner scaling down)."""
        w = self._workers.pop(worker_id)
        if self._supervisor is not None:
            await self._supervisor.unwatch(worker_id)
        w.close()
        with contextlib.suppress(Exception):
            await gather_refs(w.calls("stop"), STOP_TIMEOUT_S)
        await asyncio.to_thread(w.kill, True)
        logger.info("worker %s removed", worker_id)

    # ---- inspection and shutdown ----

    def pids(self, worker_id: str) -> list[int]:
        """The process id of each of the worker's actors, in rank order."""
        return ray.get(self._workers[worker_id].calls("pid"), timeout=self.ping_timeout_s)

    def node_ids(self, worker_id: str) -> list[str]:
        """The Ray node id each of the worker's actors runs on, in rank order."""
        return ray.get(self._workers[worker_id].calls("node_id"), timeout=self.ping_timeout_s)

    def shutdown(self) -> None:
        """Stop every actor this pool created (gracefully first) and free its groups."""
        with self._lock:
            self._closed = True
            workers = list(self._workers.values())
        for w in workers:
            w.close()
        # Only serving workers stop gracefully; a call to one still being created would wait.
        stops = [ref for w in workers if w.info is not None for ref in w.calls("stop")]
        with contextlib.suppress(Exception):
            ray.wait(stops, num_returns=len(stops), timeout=STOP_TIMEOUT_S)
        for w in workers:
            w.kill(True)
            w.not_serving()
