"""Mailbox: one request's deltas from its decode worker, taken all at once.

The decode client's reader sorts each engine step's deltas into mailboxes (`put`: an append,
and a wake-up only when the request's stream is waiting). The stream takes everything that
arrived since it last looked (`take`): one delta when it keeps up, several when it fell
behind — a client reading slower than tokens arrive (the write to it is still waiting on flow
control) or a router busier than the step rate. Those several go out as one message, so a
slow reader costs one message per read, not one per token, and what waits for it is the
deltas themselves (at most its max_tokens tokens: bounded per request). Nothing waits for more
deltas to merge: a stream that keeps up, and every first token, goes out as soon as it lands.
"""

from __future__ import annotations

import asyncio
from typing import Any


class Mailbox:
    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._waiter: asyncio.Future | None = None

    def put(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self) -> list[Any]:
        """Every item put since the last take, in order; waits for at least one."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items

    def __len__(self) -> int:
        return len(self._items)
