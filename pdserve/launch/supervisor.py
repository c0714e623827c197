"""Supervisor: watches the pool's workers and replaces each one that fails, whole.

One watch task per worker: every `interval_s` each rank must answer a ping within
`ping_timeout_s`. When one does not, the worker is reported down (`on_down(worker_id)`),
killed and launched again, every rank, under the same worker_id (retried with backoff), and
reported up with its new address (`on_up(WorkerInfo)`). A watch ends when it is cancelled or
its worker is retired (the pool shut down or removed it).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pdserve.launch.worker import Worker, gather_refs

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0

Callback = Callable[[Any], "Awaitable[None] | None"]


async def _notify(callback: Callback, arg: Any) -> None:
    try:
        result = callback(arg)
        if inspect.isawaitable(result):
            await result
    except Exception:  # the router's problem must not stop supervision
        logger.exception("worker callback %r failed", callback)


class Supervisor:
    def __init__(self, on_up: Callback, on_down: Callback, interval_s: float,
                 ping_timeout_s: float, start_timeout_s: float) -> None:
        self.on_up, self.on_down, self.interval_s = on_up, on_down, interval_s
        self.ping_timeout_s, self.start_timeout_s = ping_timeout_s, start_timeout_s
        self._watches: dict[str, asyncio.Task] = {}

    def watch(self, w: Worker) -> None:
        self._watches[w.worker_id] = asyncio.create_task(self._watch(w),
                                                         name=f"watch-{w.worker_id}")

    async def unwatch(self, worker_id: str) -> None:
        task = self._watches.pop(worker_id, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        """Cancel every watch (a relaunch under way goes on in its thread)."""
        tasks, self._watches = list(self._watches.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self, w: Worker) -> None:
        while not w.closed:
            await asyncio.sleep(self.interval_s)
            if w.info is not None and not await self._healthy(w) and not w.closed:
                w.not_serving()
                await _notify(self.on_down, w.worker_id)
                started = time.monotonic()
                if await self._restart(w):
                    logger.info("worker %s back at %s after %.1f s", w.worker_id,
                                w.info.address, time.monotonic() - started)
                    await _notify(self.on_up, w.info)

    async def _healthy(self, w: Worker) -> bool:
        """Every rank answers its ping in time."""
        try:
            await gather_refs(w.calls("ping"), self.ping_timeout_s)
            return True
        except Exception as exc:  # RayActorError (died), RayTaskError (unhealthy), timeout
            logger.warning("worker %s is down: %s", w.worker_id, repr(exc)[:500])
            return False

    async def _restart(self, w: Worker) -> bool:
        """Replace every actor of the worker, retrying with backoff; False once retired."""
        backoff = 1.0
        while not w.closed:
            try:
                await asyncio.to_thread(w.kill, False)  # its placement group is kept
                await w.start(self.start_timeout_s)
                return True
            except Exception as exc:
                logger.error("restarting worker %s failed (again in %.0f s): %r",
                             w.worker_id, backoff, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
        return False
