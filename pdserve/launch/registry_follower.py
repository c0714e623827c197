"""RegistryFollower: a `--router-only` router's worker table, kept to the owner's registry.

Every POLL_S it reads the registry (launch.registry) in a thread and applies the changes
`registry.diff` finds: a new worker, or one at a new address (restarted), is registered
(`router.add_worker` replaces the old client); one marked down is marked down here too; one
draining or gone is drained (`router.drain`, DRAIN_S at most, in a task of its own, so the
poll goes on). A registry that can't be read or is malformed is logged once and ignored: the
last good table stays. One whose deployment changed under this router (another model, block
size or mode, or another Redis when the registry named it) is `on_lost`: the router must be
started again against it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pdserve.launch import registry
from pdserve.launch.registry import Registry, WorkerEntry

logger = logging.getLogger(__name__)

POLL_S = 0.5
DRAIN_S = 30.0


class RegistryFollower:
    def __init__(self, router, redis_namespace: str,
                 incompatible: Callable[[Registry], str | None],
                 on_lost: Callable[[str], None], poll_s: float = POLL_S,
                 drain_s: float = DRAIN_S, get=registry.get) -> None:
        """`incompatible(registry)`: why this router can't serve it any more, or None."""
        self.router, self.redis_namespace = router, redis_namespace
        self.incompatible, self.on_lost = incompatible, on_lost
        self.poll_s, self.drain_s, self._get = poll_s, drain_s, get
        self.table: dict[str, WorkerEntry] = {}
        self._seen: tuple[str, int] | None = None  # (owner, revision) last applied
        self._complaint: str | None = None  # the last one logged: each is logged once
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        self._spawn(self._run())

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.poll()

    async def poll(self) -> None:
        """Read the registry once and follow it (or keep the last good table)."""
        try:
            data = await asyncio.to_thread(self._get, self.redis_namespace)
        except Exception as exc:  # noqa: BLE001 - Ray unreachable for now: keep serving
            return self._complain(f"reading the worker registry failed: {exc!r}")
        if data is None:
            return self._complain("the worker registry is gone (its owner stopped?): keeping "
                                  "the last worker table")
        try:
            found = registry.decode(data)
        except ValueError as exc:
            return self._complain(f"the worker registry is malformed, ignored: {exc}")
        self._complaint = None
        if (found.owner, found.revision) == self._seen:
            return None
        problem = self.incompatible(found)
        if problem is not None:
            logger.error("the deployment changed under this router: %s", problem)
            self.on_lost(problem)
            return None
        await self.apply(found)
        return None

    async def apply(self, found: Registry) -> None:
        """Bring the router's workers to `found`'s."""
        new = found.table()
        for change in registry.diff(self.table, new):
            if change.op == "add":
                entry = change.entry
                await self.router.add_worker(entry.worker_id, entry.role, entry.address)
            elif change.op == "down":
                self.router.mark_down(change.worker_id)
            else:
                self._spawn(self._drain(change.worker_id))
        self.table, self._seen = new, (found.owner, found.revision)

    async def _drain(self, worker_id: str) -> None:
        if worker_id not in self.router.prefill and worker_id not in self.router.decode:
            return
        try:
            await self.router.drain(worker_id, self.drain_s)
        except Exception:  # noqa: BLE001 - one worker's drain must not stop the others
            logger.exception("draining worker %s failed", worker_id)

    def _complain(self, complaint: str) -> None:
        if complaint != self._complaint:
            logger.warning("%s", complaint)
            self._complaint = complaint

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
