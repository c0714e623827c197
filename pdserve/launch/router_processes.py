"""RouterProcesses: the service's other router processes (`--router-processes N`).

The service process runs router 0 (pdserve.launch.service) and owns the worker table. N-1
more router processes (multiprocessing "spawn") bind the same gRPC and HTTP ports
(SO_REUSEPORT: the kernel spreads new connections over the processes) and serve the same
workers, each with its own Outputs subscription (its router_id): one event loop and one GIL
per process, so N of them stream about N times the tokens.

Parent <-> child: one Pipe of JSON documents (send_bytes / recv_bytes, never pickle).
  parent -> child: the start document ({"index", "spec", "secret", "workers", "log_level"}),
    then {"op": "add_worker" | "mark_down" | "drain" | "stop", ...}.
  child -> parent: {"op": "ready", "pid"} or {"op": "failed", "error"}; then every REPORT_S
    {"op": "report", "num_received", "metrics"}, and {"op": "drained", "id"} per drain.
  Abort of a request another process holds, either way: {"op": "abort", "id", "request_id"},
    answered {"op": "aborted", "id", "found"}; the parent asks its own router and the other
    children for a child.
Each child's `RouterSlot` is a follower of the parent's Router (router.router.RouterFollower),
told every change of the worker table. A child that dies (crash, SIGKILL) fails only its own
streams (their connections break; the decode workers free their KV when its subscription
stays gone): its slot logs it, keeps its totals (counters never go down) and starts a
replacement with the current worker table after a backoff. A child whose parent dies sees the
pipe close and exits. The child's side is pdserve.launch.router_child, a child's handle
pdserve.launch.router_slot.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from pdserve.cluster_secret import ClusterSecret
from pdserve.launch.router_front import RouterSpec
from pdserve.launch.router_slot import START_TIMEOUT_S, RouterSlot

logger = logging.getLogger(__name__)


class RouterProcesses:
    """Routers 1..count-1 beside the service process's own (router 0)."""

    def __init__(self, count: int, spec: RouterSpec, secret: ClusterSecret, router,
                 metrics) -> None:
        if count < 1:
            raise ValueError(f"router_processes must be >= 1, got {count}")
        self.router, self.metrics = router, metrics
        self.slots = [RouterSlot(i, spec, secret, router) for i in range(1, count)]

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start every child and wait until each serves; RuntimeError (every child stopped)
        when one cannot."""
        self.router.relay_abort = self.abort
        for slot in self.slots:
            slot.relay_abort = self.abort
            slot.spawn()
            self.router.followers.append(slot)
        self.metrics.add_source(self.expositions)
        try:
            await asyncio.gather(*(slot.wait_started(timeout_s) for slot in self.slots))
        except BaseException:
            await self.stop()
            raise
        logger.info("%d router processes serve (pids %s and this one)", len(self.slots) + 1,
                    [slot.pid for slot in self.slots])

    async def abort(self, request_id: str, asker: RouterSlot | None = None) -> bool:
        """Abort the request wherever it runs: the service process's router (unless it is the
        one asking) or a child other than the asker."""
        if asker is not None and await self.router.abort(request_id, relay=False):
            return True
        for slot in self.slots:
            if slot is not asker and await slot.abort(request_id):
                return True
        return False

    def expositions(self) -> list[str]:
        """Every child's metrics, as last reported, and what the dead ones left (any thread)."""
        return [text for slot in self.slots for text in (slot.retired_metrics, slot.exposition)
                if text]

    async def stop(self) -> None:
        self.router.relay_abort = None
        for slot in self.slots:
            if slot in self.router.followers:
                self.router.followers.remove(slot)
        await asyncio.gather(*(slot.stop() for slot in self.slots))


async def start_router_processes(settings, spec: RouterSpec, fronts, secret: ClusterSecret,
                                 metrics) -> RouterProcesses | None:
    """Routers 1..N-1 of `settings.router_processes` (None when N is 1), on the ports router 0
    (`fronts`) bound: it binds first, so port 0 (tests) means the same free port for all."""
    from pdserve.launch.router_count import available_cpus, default_router_processes

    count = settings.router_processes or default_router_processes(available_cpus())
    if count == 1:
        return None
    spec = replace(spec, port=fronts.server.port,
                   http_port=fronts.http.port if fronts.http is not None else 0)
    processes = RouterProcesses(count, spec, secret, fronts.router, metrics)
    await processes.start()
    return processes
