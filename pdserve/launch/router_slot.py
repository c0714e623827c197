"""RouterSlot: the service process's handle on one other router process, and its replacements.

It spawns the child (pdserve.launch.router_child) with its start document, forwards every
change of the worker table to it (a router.router.RouterFollower), asks it questions (drain,
abort) and applies its reports; when the child dies it keeps the child's totals and starts a
replacement after a backoff. The pipe protocol is pdserve.launch.router_processes's docstring.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import threading
import time
from collections.abc import Awaitable, Callable
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
