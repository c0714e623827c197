"""Service.stop always ends: a part that hangs is left behind and the rest still stop.

The parts are stand-ins (what is under test is the order and the bound, not the parts)."""

from __future__ import annotations

import asyncio
import time

from pdserve.launch import service as service_module
from pdserve.launch.service import Service
from pdserve.launch.settings import ServeSettings


class Hangs:
    async def stop(self) -> None:
        await asyncio.Event().wait()  # never returns


class Records:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    async def close(self) -> None:
        self.log.append(self.name)

    def stop(self) -> None:
        self.log.append(self.name)

    def shutdown(self) -> None:
        self.log.append(self.name)


def test_a_hanging_part_is_left_behind_and_the_rest_still_stop(monkeypatch):
    monkeypatch.setattr(service_module, "STOP_PART_S", 0.3)
    service, stopped = Service(ServeSettings()), []
    service.router_server = Hangs()  # e.g. a router that never finishes closing
    service.store = Records(stopped, "store")
    service.pool = Records(stopped, "pool")
    service.redis = Records(stopped, "redis")
    started = time.monotonic()
    asyncio.run(asyncio.wait_for(service.stop(), 5))  # a regression fails, never hangs
    assert time.monotonic() - started < 2.0
    assert stopped == ["store", "pool", "redis"]  # in order, after the one that hung
