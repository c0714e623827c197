"""The router's drain (`RouterServer.drain`, what SIGTERM runs before a stop), its bound:
the request in flight keeps going, a newcomer is turned away, health fails at once, and a
drain whose requests outlast `timeout_s` says how many it leaves behind. The request is held
in flight by a scripted prefill worker that does not answer until told (router_fakes)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster_secret import ClusterSecret
from pdserve.router.admission import ShuttingDown
from pdserve.router.server import NOT_SERVING, SERVING, RouterServer
from tests.faults.router_fakes import (
    TOKENS,
    FakeDecode,
    FakePrefill,
    collect,
    make_router,
    request,
    serving,
)

SECRET = ClusterSecret.generate()


async def _health(server: RouterServer) -> int:
    """The gRPC health status of the whole server, asked over its port as a probe does."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5)
    return reply.status


def test_a_drain_past_its_bound_leaves_the_request_running_and_says_so(model):
    decode, prefill = FakeDecode(), FakePrefill()

    async def scenario(d_addr, p_addr):
        router = make_router(model, SECRET)
        await router.add_worker("prefill-0", "prefill", p_addr)
        await router.add_worker(decode.worker_id, "decode", d_addr)
        server = RouterServer(router)
        await server.start()
        try:
            await router.wait_ready(10)
            await server._refresh()
            assert await _health(server) == SERVING
            prefill.hang.set()  # the request stays in flight until the prefill answers
            held = asyncio.create_task(collect(router, request("held")))
            while not prefill.requests:
                await asyncio.sleep(0.01)
            started = time.monotonic()
            left = await server.drain(0.5)
            took = time.monotonic() - started
            health, ready = await _health(server), server.can_serve()  # gRPC, HTTP /ready
            with pytest.raises(ShuttingDown):
                await collect(router, request("late"))
            prefill.hang.clear()  # the drained request still finishes, whole
            messages = await asyncio.wait_for(held, 10)
            return left, took, (health, ready), messages, await router.wait_idle(1)
        finally:
            prefill.hang.clear()
            await server.stop(grace=0)

    with serving(decode, SECRET) as d_addr, serving(prefill, SECRET) as p_addr:
        left, took, health, messages, idle = asyncio.run(scenario(d_addr, p_addr))
    assert left == 1 and 0.5 <= took < 3.0, (left, took)
    assert health == (NOT_SERVING, False)
    assert [t for m in messages for t in m.token_ids] == list(TOKENS)
    assert idle == 0
    assert len(prefill.requests) == 1 and len(decode.reserved) == 1  # the late one stayed out
