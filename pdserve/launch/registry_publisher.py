"""RegistryPublisher: the owner's worker table, kept published in Ray's GCS (launch.registry).

A follower of the owner's router (router.router.RouterFollower): the router tells it every
add_worker (start, supervisor restart, planner), mark_down (supervisor) and drain (planner),
and it publishes the new table. Puts run in a thread (`asyncio.to_thread`), one at a time and
in order, so the event loop never waits on Ray and the last put is the newest table; a failed
put is logged and the table is published again every REPUBLISH_S. A drained worker is
published as draining for DRAINING_KEEP_S (every router drains it), then dropped. `close`
deletes the key: a router started later finds no deployment.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Iterable
from dataclasses import replace

from pdserve.launch import registry
from pdserve.launch.registry import DOWN, DRAINING, UP, Registry, WorkerEntry

logger = logging.getLogger(__name__)

REPUBLISH_S = 30.0  # a put lost to a Ray hiccup (or a GCS restart) is made good this often
DRAINING_KEEP_S = 60.0


class RegistryPublisher:
    num_received = 0  # a RouterFollower that serves nothing

    def __init__(self, header: Registry, workers: Iterable[tuple[str, str, str]],
                 put=registry.put) -> None:
        """`header`: the deployment's fields of the registry (its workers are ignored);
        `workers`: (worker_id, role, address) of each worker up now; `put`: the GCS write."""
        self._header = replace(header, owner=f"owner-{secrets.token_hex(6)}", workers=())
        self._table = {wid: WorkerEntry(wid, role, address, UP)
                       for wid, role, address in workers}
        self._draining_since: dict[str, float] = {}
        self._put = put
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.revision = 0

    async def start(self) -> None:
        """Publish the table now, and again every REPUBLISH_S until `close`."""
        await self.publish()
        self._spawn(self._refresh())

    # ---- RouterFollower ----

    async def add_worker(self, worker_id: str, role: str, address: str) -> None:
        self._table[worker_id] = WorkerEntry(worker_id, role, address, UP)
        self._draining_since.pop(worker_id, None)
        await self.publish()

    def mark_down(self, worker_id: str) -> None:
        entry = self._table.get(worker_id)
        if entry is not None and entry.state == UP:
            self._table[worker_id] = replace(entry, state=DOWN)
            self._spawn(self.publish())

    async def drain(self, worker_id: str, timeout_s: float) -> None:
        """Published as draining; every other router drains it on its own (this one can't
        tell when they are done, and the owner's drain must not wait for them)."""
        entry = self._table.get(worker_id)
        if entry is not None:
            self._table[worker_id] = replace(entry, state=DRAINING)
            self._draining_since[worker_id] = time.monotonic()
            await self.publish()

    # ---- publishing ----

    def snapshot(self) -> Registry:
        now = time.monotonic()
        for worker_id, since in list(self._draining_since.items()):
            if now - since >= DRAINING_KEEP_S:
                del self._draining_since[worker_id]
                self._table.pop(worker_id, None)
        self.revision += 1
        return replace(self._header, revision=self.revision,
                       workers=tuple(self._table[w] for w in sorted(self._table)))

    async def publish(self) -> None:
        async with self._lock:  # in order: the last put is the newest table
            data = registry.encode(self.snapshot())
            try:
                await asyncio.to_thread(self._put, self._header.redis_namespace, data)
            except Exception as exc:  # noqa: BLE001 - the router must go on; retried later
                logger.warning("publishing the worker registry failed (again within %g s): %r",
                               REPUBLISH_S, exc)

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(REPUBLISH_S)
            await self.publish()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self, delete=registry.delete) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        async with self._lock:
            try:
                await asyncio.to_thread(delete, self._header.redis_namespace)
            except Exception as exc:  # noqa: BLE001 - Ray may be gone already
                logger.warning("deleting the worker registry failed: %r", exc)
