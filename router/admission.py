"""Bounded admission for the asyncio router: a fixed number of requests in flight, a bounded
FIFO queue behind them, and an immediate `Overloaded` beyond that (fail fast, never pile up).
Closed (the service drains before it stops), it turns every newcomer away with `ShuttingDown`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator

logger = logging.getLogger(__name__)


class Overloaded(Exception):
    """Raised by `Admission.acquire` when the wait queue is already full."""

    def __init__(self, max_queued: int) -> None:
        super().__init__(
            f"admission queue is full ({max_queued} requests already waiting); retry later"
        )
        self.max_queued = max_queued


class ShuttingDown(Exception):
    """Raised by `Admission.acquire` once the admission is closed: the service is draining
    (UNAVAILABLE / 503, so a client retries on another replica)."""

    def __init__(self) -> None:
        super().__init__("the service is shutting down and takes no new requests; retry on "
                         "another replica")


class Admission:
    """At most `max_inflight` holders at once; at most `max_queued` waiters, served FIFO.

    A released slot is handed directly to the oldest waiter (the in-flight count does not
    dip), so a newcomer can never overtake the queue. Use from one event loop only.
    """

    def __init__(self, max_inflight: int, max_queued: int) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0 (0 = no queue), got {max_queued}")
        self._max_inflight = max_inflight
        self._max_queued = max_queued
        self._num_inflight = 0
        self.closed = False  # see close()
        # Waiters in arrival order; a cancelled one stays here (done) until its task unwinds.
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def max_inflight(self) -> int:
        return self._max_inflight

    @property
    def max_queued(self) -> int:
        return self._max_queued

    @property
    def num_inflight(self) -> int:
        return self._num_inflight

    @property
    def num_queued(self) -> int:
        return sum(1 for fut in self._waiters if not fut.done())

    async def acquire(self) -> None:
        """Take a slot: now if one is free and nobody waits, else wait in line.

        Raises `Overloaded` at once when `max_queued` requests are already waiting, and
        `ShuttingDown` once closed.
        """
        if self.closed:
            raise ShuttingDown()
        if self._num_inflight < self._max_inflight and self.num_queued == 0:
            self._num_inflight += 1
            return
        if self.num_queued >= self._max_queued:
            raise Overloaded(self._max_queued)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # release() handed us the slot just as we were cancelled: pass it on.
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            raise

    def close(self) -> None:
        """Admit nobody new from now on; the requests in flight and those already waiting in
        line keep their places."""
        self.closed = True

    def release(self) -> None:
        """Give a slot back: to the oldest live waiter if there is one, else to the pool."""
        if self._num_inflight <= 0:
            raise RuntimeError("Admission.release() called with no slot held")
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():  # skip waiters cancelled while queued
                fut.set_result(None)  # the slot moves to it; num_inflight is unchanged
                return
        self._num_inflight -= 1

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """`async with admission.slot(): ...` holds one slot for the block."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()
