"""Failures of the parts around the service: Redis stopped and restarted, workers killed.

Two prefill workers (head node) and two decode workers (second node), real processes: the
tests SIGKILL a worker's process and stop the real redis-server under a running service.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from pdserve.client import AsyncClient, Client, PdserveError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import worker_pb2, worker_pb2_grpc
from tests.e2e.harness import health, running, stats, tiny_settings, wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
RESTART_S = 120.0


@pytest.fixture(scope="module")
def service(ray_cluster, tiny_llama_dir):
    with running(tiny_settings(tiny_llama_dir, ray_cluster.address, prefill_workers=2,
                               decode_workers=2)) as service:
        yield service



def running_on(service, worker_id: str) -> int:
    """Requests running on a decode worker now (asked of the worker itself, as the router)."""
    address = service.router.decode[worker_id].address  # GetStats hands out no addresses
    with grpc.insecure_channel(address) as channel:
        load = worker_pb2_grpc.DecodeWorkerStub(channel).GetLoad(
            worker_pb2.GetLoadRequest(), timeout=5,
            metadata=service.service.secret.grpc_metadata())
    return load.num_running


def addresses(service) -> dict[str, str]:
    return {c.worker_id: c.address for c in service.router.workers()}


def prefix_owner(service, prompt: list[int]) -> tuple[str, int]:
    """Where the router would prefill `prompt`, and its prefix hit there (tokens)."""
    client, hit, _ = service.run(service.router.placer.choose_prefill(prompt))
    return client.worker_id, hit


def test_redis_stopped_mid_run_degrades_and_recovers(service):
    redis_server = service.service.redis
    prompt = list(range(1000, 1070))  # 4 full blocks and a partial one
    with Client(service.address, timeout=60) as client:
        client.complete(prompt, sampling=GREEDY)
        owner, _ = wait_until(lambda: (o := prefix_owner(service, prompt))[1] == 64 and o,
                              10, "the prefix index names the worker holding the prompt")
        redis_server.stop()
        try:
            # serving goes on without Redis: sessions and prefix routing fail open
            for i in range(3):
                done = client.complete(prompt[: 20 + i], sampling=GREEDY, session_id=f"s{i}")
                assert done.usage.completion_tokens == 8
            assert wait_until(lambda: health(service.address, "pdserve.redis") == "NOT_SERVING",
                              5, "health reports Redis down")
            assert health(service.address) == "SERVING"
            assert not stats(service.address).redis_up
            assert prefix_owner(service, prompt)[1] == 0  # no index: load-only routing
        finally:
            redis_server.start()  # same port, empty
        assert wait_until(lambda: health(service.address, "pdserve.redis") == "SERVING",
                          10, "health reports Redis back")
        # the workers re-publish their whole cache: prefix routing is back where it was
        assert wait_until(lambda: prefix_owner(service, prompt) == (owner, 64), 15,
                          "prefix routing resumes")
        assert stats(service.address).redis_up
        assert client.complete(prompt, sampling=GREEDY).usage.cached_tokens == 64


def idle_decode_workers(service):
    """Both decode workers, once the router sees them up and holding no blocks."""
    decode = [w for w in stats(service.address).workers if w.worker_id.startswith("decode")]
    return len(decode) == 2 and all(w.up and w.num_used_blocks == 0 for w in decode) and decode


def migrated(service) -> float:
    return service.router.metrics.registry.get_sample_value(
        "pdserve_router_migrations_total", {"outcome": "ok"})


def test_killed_decode_worker_migrates_its_streams_and_comes_back(service):
    """SIGKILL a decode worker under 8 streams: each of its streams moves to the other decode
    worker (migration_limit 1, the default) and every stream ends exactly as it does
    undisturbed, greedy and seeded alike."""
    params = [SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=0.8, seed=i, max_tokens=300, ignore_eos=True)
        for i in range(4)]
    pool = service.service.pool

    async def stream(client, i, started=None):
        tokens = []
        try:
            async for chunk in client.generate([3, 4, 5, i], sampling=params[i]):
                tokens += chunk.token_ids
                if started is not None and len(tokens) >= 5:
                    started.set()
            return chunk.finish_reason, tokens
        except PdserveError as exc:
            return exc.code.name, tokens

    async def run():
        async with AsyncClient(service.address, timeout=120) as client:
            undisturbed = await asyncio.gather(*(stream(client, i) for i in range(8)))
            # the router's load snapshots show both workers idle again: the streams spread
            await asyncio.to_thread(wait_until, lambda: idle_decode_workers(service), 10,
                                    "decode workers idle")
            events = [asyncio.Event() for _ in range(8)]
            tasks = [asyncio.create_task(stream(client, i, e)) for i, e in enumerate(events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            by_worker = {w: running_on(service, w) for w in service.router.decode}
            before = migrated(service)
            os.kill(pool.pids("decode-0")[0], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)  # never hangs
            return undisturbed, by_worker, results, migrated(service) - before

    undisturbed, by_worker, results, num_migrated = asyncio.run(run())
    assert by_worker["decode-0"] > 0 and by_worker["decode-1"] > 0, by_worker
    assert all(r == "length" and len(t) == 300 for r, t in undisturbed), undisturbed
    assert len({tuple(t) for _, t in undisturbed[4:]}) == 4  # the seeds do differ
    assert results == undisturbed  # no token lost, none twice, the same choices
    assert num_migrated == by_worker["decode-0"]
    up = wait_until(lambda: all(w.up for w in stats(service.address).workers), RESTART_S,
                    "decode-0 restarted and re-registered")
    assert up
    with Client(service.address, timeout=60) as client:
        for i in range(4):  # both decode workers serve again
            assert client.complete([8, 8, i], sampling=GREEDY).usage.completion_tokens == 8

    # the router's load snapshot lags a finished request by <= 0.2 s
    idle = wait_until(lambda: idle_decode_workers(service), 5,
                      "every decode worker holds no blocks")
    assert all(w.num_blocks == 256 for w in idle), idle


def test_killed_prefill_worker_is_routed_around_then_restarted(service):
    pool = service.service.pool
    before = addresses(service)
    os.kill(pool.pids("prefill-0")[0], signal.SIGKILL)
    with Client(service.address, timeout=60) as client:
        for i in range(6):  # right after the kill: retried on prefill-1, none fails
            assert client.complete([11, 12, i] * 7, sampling=GREEDY).usage.completion_tokens == 8
        wait_until(lambda: all(w.up for w in stats(service.address).workers), RESTART_S,
                   "prefill-0 restarted and re-registered")
        after = addresses(service)
        assert after["prefill-0"] != before["prefill-0"]
        assert client.complete([13, 14, 15] * 7, sampling=GREEDY).usage.completion_tokens == 8
