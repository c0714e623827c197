"""RouterProcesses: the service's other router processes (`--router-processes N`).

The service process runs router 0 (pdserve.launch.service) and owns the worker table. N-1
more router processes (multiprocessing "spawn") bind the same gRPC and HTTP ports
(SO_REUSEPORT: the kernel spreads new connections over the processes) and serve the same
workers, each with its own Outputs subscription (its router_id): one event loop and one GIL
per process, so N of them stream about N times the tokens. Unless told, `pdserve up` runs one
per 16 usable cores, 1 to 8 (`default_router_processes`); usable cores: the process's CPU
affinity (a cpuset), capped by a cgroup v2 CPU quota (a Kubernetes CPU limit), which affinity
does not show.

Parent <-> child: one Pipe of JSON documents (send_bytes / recv_bytes, never pickle).
  parent -> child: the start document ({"index", "spec", "secret", "workers", "log_level"}),
    then {"op": "add_worker" | "mark_down" | "drain" | "drain_router" | "stop", ...}
    ("drain" a worker: the planner's scale-in; "drain_router": the whole router, before a stop).
  child -> parent: {"op": "ready", "pid"} or {"op": "failed", "error"}; then every REPORT_S
    {"op": "report", "num_received", "metrics"}, and {"op": "drained", "id"} per drain of
    either kind.
  Abort of a request another process holds, either way: {"op": "abort", "id", "request_id"},
    answered {"op": "aborted", "id", "found"}; the parent asks its own router and the other
    children for a child.
Each child's `RouterSlot`, the service process's handle on it and its replacements, is a
follower of the parent's Router (router.router.RouterFollower): it spawns the child with its
start document, forwards every change of the worker table to it, asks it questions (drain,
abort) and applies its reports. A child that dies (crash, SIGKILL) fails only its own
streams (their connections break; the decode workers free their KV when its subscription
stays gone): its slot logs it, keeps its totals (counters never go down) and starts a
replacement with the current worker table after a backoff. A child whose parent dies sees the
pipe close and exits. The child's side is pdserve.launch.router_child.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.cluster_secret import ClusterSecret
from pdserve.launch.router_child import child_main
from pdserve.launch.router_front import RouterSpec
from pdserve.router.metrics_merge import merge_expositions, totals_only

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a child's interpreter, imports and tokenizer, on a busy machine
ABORT_TIMEOUT_S = 5.0  # a child's answer to "do you hold this request?"
STOP_TIMEOUT_S = 10.0  # asked to stop, a child gets this long before it is killed
RESTART_S, RESTART_MAX_S = 1.0, 30.0  # backoff before a replacement, doubling while it crashes
STABLE_S = 60.0  # a child that lived this long died by accident, not in a crash loop
CORES_PER_ROUTER, MAX_ROUTERS = 16, 8


def default_router_processes(cpu_count: int) -> int:
    """One router process per 16 cores, 1 to 8: a router saturates one core at several
    decode workers' token rate; the rest of the machine is the workers' (or other pods')."""
    return max(1, min(MAX_ROUTERS, cpu_count // CORES_PER_ROUTER))


def available_cpus(cgroup_cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may use: its CPU affinity (a cpuset), capped by a cgroup v2 CPU
    quota (a Kubernetes CPU limit), which affinity does not show."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota = cpu_quota(Path(cgroup_cpu_max).read_text())
    except OSError:  # no cgroup v2 CPU controller here
        quota = None
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def cpu_quota(cpu_max: str) -> float | None:
    """Cores a cgroup v2 `cpu.max` ("<quota> <period>" or "max <period>") allows; None: no
    limit."""
    quota, _, period = cpu_max.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


class RouterSlot:
    """Router process `index`, and its replacements: a follower of the parent's Router."""

    def __init__(self, index: int, spec: RouterSpec, secret: ClusterSecret, router) -> None:
        self.index, self.spec, self.secret, self.router = index, spec, secret, router
        self.num_received = 0  # requests its processes accepted, ever (RouterFollower)
        self.exposition = ""  # the current process's metrics, as last reported
        self.retired_metrics = ""  # the totals its dead processes left
        self.process: multiprocessing.process.BaseProcess | None = None
        self.ready = False
        self.generation = 0  # processes started, ever
        self._conn = None
        self._base_received = 0  # what the dead processes had accepted
        self._started: asyncio.Future | None = None
        self._replies: dict[int, asyncio.Future] = {}  # our question's id -> its answer
        self._next_id = 0
        self.relay_abort: Callable[[str, RouterSlot], Awaitable[bool]] | None = None
        self._stopping = False
        self._failures = 0  # deaths in a row, each soon after its start
        self._spawned_at = 0.0
        self._tasks: set[asyncio.Task] = set()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def spawn(self) -> None:
        """Start a process with the current worker table; the table and the changes after it
        reach the child in order (nothing awaits in between)."""
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        process = ctx.Process(target=child_main, args=(child_conn,), daemon=True,
                              name=f"pdserve-router-{self.index}")
        process.start()
        child_conn.close()  # the child's end is the child's: its death is our EOF
        # a draining worker is on its way out: the new router never takes it on
        workers = [(c.worker_id, c.role, c.address) for c in self.router.workers()
                   if not c.draining]
        start = {"index": self.index, "spec": self.spec.to_json(), "workers": workers,
                 "secret": self.secret.value.decode(),
                 "log_level": logging.getLogger().getEffectiveLevel()}
        conn.send_bytes(json.dumps(start).encode())
        loop = asyncio.get_running_loop()
        self.process, self._conn, self.ready = process, conn, False
        self.generation += 1
        self._spawned_at = time.monotonic()
        self._started = loop.create_future()
        threading.Thread(target=self._read, args=(process, conn, loop), daemon=True,
                         name=f"pdserve-router-{self.index}-pipe").start()
        self._spawn_task(self._watch_start(process))

    async def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until the current process serves; RuntimeError when it failed to start."""
        await asyncio.wait_for(asyncio.shield(self._started), timeout_s)

    # ---- RouterFollower ----

    async def add_worker(self, worker_id: str, role: str, address: str) -> None:
        self._send({"op": "add_worker", "worker_id": worker_id, "role": role,
                    "address": address})

    def mark_down(self, worker_id: str) -> None:
        self._send({"op": "mark_down", "worker_id": worker_id})

    async def drain(self, worker_id: str, timeout_s: float) -> None:
        """Until the child has drained the worker (its own wait is bounded by timeout_s)."""
        # no process: its replacement gets the table without it
        answer = await self._ask({"op": "drain", "worker_id": worker_id, "timeout_s": timeout_s},
                                 timeout_s + STOP_TIMEOUT_S)
        if answer is None and self._conn is not None:
            logger.warning("router process %d did not drain %s in time", self.index, worker_id)

    async def drain_router(self, timeout_s: float) -> None:
        """Until the child's router has drained (`RouterServer.drain`), at most timeout_s."""
        answer = await self._ask({"op": "drain_router", "timeout_s": timeout_s},
                                 timeout_s + STOP_TIMEOUT_S)
        if answer is None and self._conn is not None:
            logger.warning("router process %d did not drain in time", self.index)

    async def abort(self, request_id: str) -> bool:
        """Abort the request if this child holds it."""
        answer = await self._ask({"op": "abort", "request_id": request_id}, ABORT_TIMEOUT_S)
        return bool(answer and answer.get("found"))

    async def _ask(self, message: dict[str, Any], timeout_s: float) -> dict | None:
        """Send a question; its answer, or None (no process, it died, or no answer in time)."""
        self._next_id += 1
        ask_id, answer = self._next_id, asyncio.get_running_loop().create_future()
        self._replies[ask_id] = answer
        try:
            if not self._send({**message, "id": ask_id}):
                return None
            return await asyncio.wait_for(answer, timeout_s)
        except TimeoutError:
            return None
        finally:
            self._replies.pop(ask_id, None)

    # ---- the pipe ----

    def _send(self, message: dict[str, Any]) -> bool:
        """True when sent; a dead or absent child is not an error (its replacement starts
        from the current table)."""
        if self._conn is None:
            return False
        try:
            self._conn.send_bytes(json.dumps(message).encode())
            return True
        except OSError:
            return False

    def _read(self, process, conn, loop: asyncio.AbstractEventLoop) -> None:
        """The pipe's reader thread: each message onto the loop, then the EOF."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the service stopped
            with contextlib.suppress(EOFError, OSError):
                while True:
                    message = json.loads(conn.recv_bytes())
                    loop.call_soon_threadsafe(self._on_message, process, message)
            loop.call_soon_threadsafe(self._on_exit, process)

    def _on_message(self, process, message: dict[str, Any]) -> None:
        if process is not self.process:
            return
        op = message.get("op")
        if op == "report":
            self.num_received = self._base_received + int(message["num_received"])
            self.exposition = message["metrics"]
        elif op in ("drained", "aborted"):
            answer = self._replies.get(message["id"])
            if answer is not None and not answer.done():
                answer.set_result(message)
        elif op == "abort" and self.relay_abort is not None:  # the child does not hold it
            self._spawn_task(self._answer_abort(message))
        elif op == "ready":
            self.ready = True
            logger.info("router process %d (pid %d) serving", self.index, message["pid"])
            if not self._started.done():
                self._started.set_result(None)
        elif op == "failed":
            logger.error("router process %d failed to start: %s", self.index, message["error"])
            if not self._started.done():
                self._started.set_exception(RuntimeError(
                    f"router process {self.index} failed to start: {message['error']}"))

    def _on_exit(self, process) -> None:
        if process is not self.process:
            return
        self._conn.close()
        self._conn, self.ready = None, False
        # its last report stands for its totals; its gauges (queue, in flight) go with it
        self._base_received = self.num_received
        self.retired_metrics = merge_expositions(self.retired_metrics,
                                                 [totals_only(self.exposition)])
        self.exposition = ""
        for answer in self._replies.values():
            if not answer.done():
                answer.set_result(None)
        if self._stopping:
            return
        if not self._started.done():
            self._started.set_exception(RuntimeError(
                f"router process {self.index} exited while starting"))
        self._spawn_task(self._replace(process))

    async def _replace(self, process) -> None:
        """Reap the dead process; after a backoff, start its replacement."""
        await asyncio.to_thread(process.join, STOP_TIMEOUT_S)
        lived = time.monotonic() - self._spawned_at
        self._failures = 0 if lived > STABLE_S else self._failures + 1
        delay = min(RESTART_MAX_S, RESTART_S * 2 ** max(0, self._failures - 1))
        logger.error("router process %d (pid %s) exited with code %s after %.0f s: its "
                     "streams failed; a replacement starts in %g s", self.index, process.pid,
                     process.exitcode, lived, delay)
        while True:
            await asyncio.sleep(delay)
            try:
                self.spawn()
                return
            except Exception:  # e.g. out of processes: try again, later
                logger.exception("router process %d could not be started", self.index)
                delay = min(RESTART_MAX_S, 2 * delay)

    async def _watch_start(self, process) -> None:
        """A child that neither serves nor fails within START_TIMEOUT_S is killed (and so
        replaced)."""
        try:
            await self.wait_started(START_TIMEOUT_S)
        except TimeoutError:
            if process is self.process and process.is_alive():
                logger.error("router process %d did not start in %g s: killed", self.index,
                             START_TIMEOUT_S)
                process.kill()
        except RuntimeError:
            pass

    async def _answer_abort(self, message: dict[str, Any]) -> None:
        found = await self.relay_abort(message["request_id"], self)
        self._send({"op": "aborted", "id": message["id"], "found": found})

    def _spawn_task(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Ask the child to stop; kill it after STOP_TIMEOUT_S."""
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        process = self.process
        if process is None:
            return
        self._send({"op": "stop"})
        await asyncio.to_thread(process.join, STOP_TIMEOUT_S)
        if process.is_alive():
            logger.error("router process %d did not stop in %g s: killed", self.index,
                         STOP_TIMEOUT_S)
            process.kill()
            await asyncio.to_thread(process.join, STOP_TIMEOUT_S)


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

    async def drain(self, timeout_s: float) -> None:
        """Every child's router drains (see `RouterServer.drain`), at most timeout_s."""
        await asyncio.gather(*(slot.drain_router(timeout_s) for slot in self.slots))

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
    count = settings.router_processes or default_router_processes(available_cpus())
    if count == 1:
        return None
    spec = replace(spec, port=fronts.server.port,
                   http_port=fronts.http.port if fronts.http is not None else 0)
    processes = RouterProcesses(count, spec, secret, fronts.router, metrics)
    await processes.start()
    return processes
