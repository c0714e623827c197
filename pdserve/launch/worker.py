"""Worker: one worker of the pool as Ray holds it, its actors and (decode) placement group.

A prefill worker is one actor, placed by the `prefill` resource. A decode worker is a TP
group: one actor per rank in one placement group whose bundle 0 holds the `decode` resource,
placed by the deployment's strategy (`defaults.TP_PLACEMENTS`, Ray's: STRICT_PACK, every rank
on one node, by default; PACK or SPREAD, ranks may cross nodes; STRICT_SPREAD, a node each).
Ray never restarts an actor itself (max_restarts=0): a TP group only works whole, so a failed
worker is killed and launched again, every rank, under the same worker_id.
Every actor starts with the cluster secret (and the Redis password) in its environment
(Ray's runtime_env), so neither travels in argv, actor arguments or logs.

A worker of a named deployment (`deployment`: `pdserve up` on a cluster it joined) is detached
from its owner: its actors are named `<deployment>/<worker id>/<launch>/<rank>` and its
placement group `<deployment>/<worker id>`, both with Ray's detached lifetime in the drivers'
namespace (`defaults.RAY_NAMESPACE`), so they outlive an owner that dies (SIGKILL, OOM, its
node lost) and keep serving the deployment's other routers. The owner's replacement `adopt`s
them: every rank of a launch alive, started with the spec it would start, holding its
cluster secret (a signed challenge) and serving; anything else of the worker's it finds is
killed and the worker launched anew. An owner that stops (Ctrl-C, SIGTERM after the drain)
stops its workers as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve import defaults
from pdserve.cluster_secret import ClusterSecret
from pdserve.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"  # the roles, and the custom resources that place them


Launches = dict[str, dict[int, Any]]  # a worker's launches left running: launch -> rank -> actor


def deployment_launches(deployment: str) -> dict[str, Launches]:
    """The actors a deployment's workers run now, by worker id, launch and rank (their names,
    `<deployment>/<worker id>/<launch>/<rank>`, read from Ray once)."""
    found: dict[str, Launches] = {}
    for name in ray.util.list_named_actors():
        parts = name.split("/")
        if len(parts) == 4 and parts[0] == deployment and parts[3].isdigit():
            with contextlib.suppress(ValueError):  # gone meanwhile
                actor = ray.get_actor(name)
                found.setdefault(parts[1], {}).setdefault(parts[2], {})[int(parts[3])] = actor
    return found


def retire(prefix: str, launches: Launches, placement_group: bool = True) -> None:
    """Kill every actor of `launches` and (`placement_group`) the placement group named
    `prefix` (`<deployment>/<worker id>`), where one exists."""
    for ranks in launches.values():
        for actor in ranks.values():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
    if placement_group:
        with contextlib.suppress(ValueError):  # none (a prefill worker, or never created)
            remove_placement_group(ray.util.get_placement_group(prefix))


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str  # "prefill" | "decode"
    address: str  # its gRPC service (rank 0's for a decode group)
    tp_size: int = 1


@functools.cache
def _actor_class(role: str) -> Any:
    # imported on first use: a process that starts no worker needs no torch
    if role == PREFILL:
        from pdserve.prefill_worker.actor import PrefillActor as cls
    else:
        from pdserve.decode_worker.actor import DecodeRankActor as cls
    return ray.remote(cls)


async def _await(ref: Any) -> Any:
    return await ref


async def gather_refs(refs: Sequence[Any], timeout_s: float) -> list[Any]:
    """Every ref's value; raises the first failure, but only once every ref has settled."""
    gathered = asyncio.gather(*map(_await, refs), return_exceptions=True)
    # when the wait is cancelled or times out, the cancelled gather's outcome is nobody's news
    gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
    values = await asyncio.wait_for(gathered, timeout_s)
    for value in values:
        if isinstance(value, BaseException):
            raise value
    return values


class Worker:
    """The actors of one worker; `info` is its WorkerInfo while it serves, else None."""

    def __init__(self, spec: WorkerSpec, role: str, tp_size: int, cpus: float,
                 gpus: bool, *, secret: ClusterSecret, redis_password: str | None = None,
                 tp_placement: str = "STRICT_PACK", deployment: str | None = None) -> None:
        if tp_placement not in defaults.TP_PLACEMENTS:
            raise ValueError("tp_placement must be one of "
                             f"{', '.join(defaults.TP_PLACEMENTS)}, got {tp_placement!r}")
        self.spec, self.role, self.tp_size = spec, role, tp_size
        self.tp_placement, self.deployment = tp_placement, deployment
        self.secret = secret
        self.env = secret.to_env() | (
            {defaults.REDIS_PASSWORD_ENV: redis_password} if redis_password else {})
        self.cpus, self.gpus = cpus, gpus  # per actor (each decode rank is one)
        self.info: WorkerInfo | None = None
        self._actors: list[Any] = []  # rank order
        self._pg: PlacementGroup | None = None
        self._closed = False
        self._lock = threading.Lock()  # actors, pg and closed: relaunches run in threads

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    @property
    def closed(self) -> bool:
        """Retired (the pool shut down or removed it): it is never launched again."""
        return self._closed

    def bundle(self, rank: int) -> dict[str, float]:
        """What one actor of the worker takes; rank 0 also takes the role's resource."""
        bundle = {"CPU": self.cpus} | ({"GPU": 1} if self.gpus else {})
        return bundle | ({self.role: 1} if rank == 0 else {})

    def node_bundles(self) -> list[Counter[str]]:
        """What the worker needs of each node its placement strategy binds it to: a
        STRICT_PACK group's ranks together on one, a STRICT_SPREAD group's each on its own;
        none where Ray may place the ranks as they fit (a prefill worker, PACK, SPREAD)."""
        if self.role != DECODE or self.tp_placement not in ("STRICT_PACK", "STRICT_SPREAD"):
            return []
        ranks = [Counter(self.bundle(r)) for r in range(self.tp_size)]
        return ranks if self.tp_placement == "STRICT_SPREAD" else [sum(ranks, Counter())]

    @property
    def _prefix(self) -> str:
        """The worker's names in the deployment: its placement group's, its actors' start."""
        return f"{self.deployment}/{self.worker_id}"

    def launch(self) -> list[Any]:
        """Create the actors; refs whose first value is the worker's address once it serves."""
        opts = {"max_restarts": 0, "max_task_retries": 0, "num_cpus": self.cpus,
                "num_gpus": 1 if self.gpus else 0,
                "runtime_env": {"env_vars": self.env}}
        named = self.deployment is not None
        launch = f"{self._prefix}/{secrets.token_hex(4)}"  # a relaunch's names are new ones

        def naming(rank: int) -> dict[str, Any]:  # a deployment's actors: detached, by name
            return {"name": f"{launch}/{rank}", "lifetime": "detached"} if named else {}

        cls, spec = _actor_class(self.role), self.spec.to_dict()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"worker {self.worker_id} is retired (pool shut down or "
                                   "worker removed)")
            if self.role == PREFILL:
                self._actors = [cls.options(resources={PREFILL: 1}, max_concurrency=2,
                                            **naming(0), **opts).remote(spec)]
                return [self._actors[0].address.remote()]
            if self._pg is None or placement_group_table(self._pg).get("state") in (
                    None, "REMOVED"):
                self._pg = placement_group([self.bundle(r) for r in range(self.tp_size)],
                                           strategy=self.tp_placement,
                                           name=self._prefix if named else "",
                                           lifetime="detached" if named else None)
            self._actors = [
                cls.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, r),
                    resources={DECODE: 1} if r == 0 else {}, max_concurrency=4,
                    **naming(r), **opts,
                ).remote(spec, r, self.tp_size)
                for r in range(self.tp_size)
            ]
            rendezvous = self._actors[0].rendezvous.remote()
            return [a.start.remote(rendezvous) for a in self._actors]

    def adopt(self, launches: Launches, timeout_s: float) -> WorkerInfo | None:
        """Of `launches` (this worker's, as `deployment_launches` found them), the one an
        earlier owner left serving, taken over if every rank of it is alive, was started with
        this worker's spec and group size and signs a challenge with this pool's cluster
        secret: its info, or None. The others (cut short, other settings, another secret) are
        killed, and the placement group too when none is taken, so a launch starts clean."""
        adopted, taken = None, None
        for launch, ranks in launches.items():
            if sorted(ranks) == list(range(self.tp_size)):
                adopted = self._take([ranks[r] for r in sorted(ranks)], timeout_s)
                if adopted is not None:
                    taken = launch
                    break
        retire(self._prefix, {k: v for k, v in launches.items() if k != taken},
               placement_group=adopted is None)
        if adopted is not None and self.role == DECODE:
            self._pg = ray.util.get_placement_group(self._prefix)
        return adopted

    def _take(self, actors: list[Any], timeout_s: float) -> WorkerInfo | None:
        challenge = secrets.token_hex(16)
        try:
            found = ray.get([a.identity.remote(challenge) for a in actors], timeout=timeout_s)
            address = ray.get(actors[0].ping.remote(), timeout=timeout_s)
        except Exception as e:  # a rank dead or stuck: not a worker to adopt
            logger.info("worker %s: a launch left running does not answer (%s)",
                        self.worker_id, e)
            return None
        spec = self.spec.to_dict()
        for identity in found:
            if identity["spec"] != spec or identity.get("tp_size", 1) != self.tp_size:
                logger.info("worker %s: the launch left running has other settings; "
                            "launching anew", self.worker_id)
                return None
            if not self.secret.verify(identity["proof"], "adopt", challenge):
                logger.info("worker %s: the launch left running holds another cluster "
                            "secret; launching anew", self.worker_id)
                return None
        with self._lock:
            self._actors = actors
        return self.serving(address)

    def serving(self, address: str) -> WorkerInfo:
        """Record that the launched actors serve at `address`."""
        self.info = WorkerInfo(self.worker_id, self.role, address, self.tp_size)
        return self.info

    async def start(self, timeout_s: float) -> WorkerInfo:
        """Launch (from a thread: Ray's calls block) and wait until the worker serves."""
        refs = await asyncio.to_thread(self.launch)
        address, *_ = await gather_refs(refs, timeout_s)
        return self.serving(address)

    def not_serving(self) -> None:
        """Record that the worker is down (until a relaunch serves)."""
        self.info = None

    def calls(self, method: str) -> list[Any]:
        """One call of an actor method on every rank; their refs."""
        return [getattr(actor, method).remote() for actor in self._actors]

    def describe(self) -> str:
        """What the worker waits for, for a start that times out."""
        if self.role == PREFILL:
            return f"{self.worker_id} needs {self.bundle(0)}"
        state = placement_group_table(self._pg).get("state") if self._pg is not None else None
        bundles = [self.bundle(r) for r in range(self.tp_size)]
        return (f"{self.worker_id} needs {bundles} placed {self.tp_placement} (placement "
                f"group {state})")

    def close(self) -> None:
        """Retire the worker: a launch from now on fails (one under way finishes first)."""
        with self._lock:
            self._closed = True

    def kill(self, remove_pg: bool) -> None:
        """Kill every actor (and free the placement group unless it is kept for a relaunch)."""
        with self._lock:
            actors, self._actors = self._actors, []
            pg = self._pg
            if remove_pg:
                self._pg = None
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if remove_pg and pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
