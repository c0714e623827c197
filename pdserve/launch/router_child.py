"""One extra router process of `--router-processes` (started by pdserve.launch.router_processes).

It reads its start document from the pipe (the RouterSpec, the cluster secret, the worker
table), builds its Router and fronts exactly as the service process does (RouterFronts), binds
the service's gRPC and HTTP ports beside the others (SO_REUSEPORT), and serves on uvloop. Then
it follows the parent's word (worker-table changes, drains of a worker or of this router,
aborts, stop), asks it for an Abort of a request this process does not hold, and reports its
request count and metrics every REPORT_S. The pipe closing (the parent died) stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

from pdserve.cluster_secret import ClusterSecret
from pdserve.launch.router_front import RouterFronts, RouterSpec

logger = logging.getLogger(__name__)

REPORT_S = 1.0
# the parent asks its router and the other children, each within 5 s
ABORT_TIMEOUT_S = 12.0
READY_S = 30.0  # then it serves anyway, its health naming the workers it cannot reach


def child_main(conn: Connection) -> None:
    """The process's entry point."""
    # Ctrl-C reaches the whole process group; the parent stops its children itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start = json.loads(conn.recv_bytes())
    logging.basicConfig(level=start["log_level"], format=(
        f"%(asctime)s %(levelname)s router-{start['index']} %(name)s: %(message)s"))
    import uvloop

    uvloop.run(_serve(conn, start))


async def _serve(conn: Connection, start: dict[str, Any]) -> None:
    spec = RouterSpec.from_json(start["spec"])
    secret = ClusterSecret.from_text(start.pop("secret"))
    fronts = None
    try:
        fronts = await RouterFronts.bind(spec, secret, [tuple(w) for w in start["workers"]])
        await fronts.start(READY_S, require_ready=False)
    except Exception as exc:
        logger.exception("router process could not start")
        _send(conn, {"op": "failed", "error": f"{type(exc).__name__}: {exc}"})
        if fronts is not None:
            await fronts.stop(grace=0)
        return
    _send(conn, {"op": "ready", "pid": os.getpid()})
    try:
        await _Follower(conn, fronts).run()
    finally:
        await fronts.stop()


class _Follower:
    """The parent's word, applied to this process's router; its reports."""

    def __init__(self, conn: Connection, fronts: RouterFronts) -> None:
        self.conn, self.router, self.metrics = conn, fronts.router, fronts.metrics
        self.server = fronts.server
        self._tasks: set[asyncio.Task] = set()
        self._answers: dict[int, asyncio.Future] = {}  # our abort questions to the parent
        self._next_id = 0
        self.router.relay_abort = self._abort_elsewhere

    async def run(self) -> None:
        """Until the parent says stop or is gone."""
        reporter = asyncio.create_task(self._report())
        try:
            while True:
                try:
                    message = json.loads(await asyncio.to_thread(self.conn.recv_bytes))
                except (EOFError, OSError):
                    logger.warning("the service process is gone: this router stops")
                    return
                if message["op"] == "stop":
                    return
                try:
                    await self._apply(message)
                except Exception:  # one bad change must not take the whole router down
                    logger.exception("applying %s failed", message["op"])
        finally:
            reporter.cancel()
            for task in list(self._tasks):
                task.cancel()

    async def _apply(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "aborted":  # the parent's answer to our question
            answer = self._answers.get(message["id"])
            if answer is not None and not answer.done():
                answer.set_result(bool(message["found"]))
            return
        if op == "abort":  # the parent asks: do we hold it?
            self._background(self._answer_abort(message))
            return
        if op == "drain_router":  # the service drains before it stops
            self._background(self._drain_router(message["id"], message["timeout_s"]))
            return
        worker_id = message["worker_id"]
        if op == "add_worker":
            await self.router.add_worker(worker_id, message["role"], message["address"])
        elif op == "mark_down":
            self.router.mark_down(worker_id)
        elif op == "drain":  # in the background: later changes must not wait for it
            self._background(self._drain(message["id"], worker_id, message["timeout_s"]))
        else:
            logger.error("unknown message from the service process: %r", op)

    async def _answer_abort(self, message: dict[str, Any]) -> None:
        found = await self.router.abort(message["request_id"], relay=False)
        _send(self.conn, {"op": "aborted", "id": message["id"], "found": found})

    async def _abort_elsewhere(self, request_id: str) -> bool:
        """Ask the parent whether another router process holds the request (and abort it)."""
        self._next_id += 1
        ask_id, answer = self._next_id, asyncio.get_running_loop().create_future()
        self._answers[ask_id] = answer
        try:
            _send(self.conn, {"op": "abort", "id": ask_id, "request_id": request_id})
            return await asyncio.wait_for(answer, ABORT_TIMEOUT_S)
        except TimeoutError:
            return False
        finally:
            self._answers.pop(ask_id, None)

    def _background(self, coro) -> None:  # later messages must not wait for it
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, drain_id: int, worker_id: str, timeout_s: float) -> None:
        if any(c.worker_id == worker_id for c in self.router.workers()):
            await self.router.drain(worker_id, timeout_s)
        _send(self.conn, {"op": "drained", "id": drain_id})

    async def _drain_router(self, drain_id: int, timeout_s: float) -> None:
        await self.server.drain(timeout_s)
        _send(self.conn, {"op": "drained", "id": drain_id})

    async def _report(self) -> None:
        while True:
            _send(self.conn, {"op": "report", "num_received": self.router.num_received,
                              "metrics": self.metrics.render().decode()})
            await asyncio.sleep(REPORT_S)


def _send(conn: Connection, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the parent is gone: the reader sees it and stops
        conn.send_bytes(json.dumps(message).encode())
