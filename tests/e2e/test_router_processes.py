"""`router_processes=2`: two router processes on one gRPC and one HTTP port, one worker pool.

One service for the module (colocated, one decode worker: the cheapest pool on 2 cores) over
real Ray, Redis and gRPC, with TLS and an API token on both fronts (every router process must
hold them). Every client stream has a connection of its own (a channel with a local subchannel
pool), since the kernel spreads connections, not streams, over the processes.
Which process serves a stream is read from the service process's router (its flights and
request count) and the child's reports.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import ssl
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client import generate_latest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.launch.router_child import REPORT_S
from pdserve.llm import LLM
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.metrics_text import sample_value
from tests.certs import write_pki
from tests.e2e.harness import (
    free_port,
    greedy_stream,
    offline_greedy,
    running,
    tiny_settings,
    token_prompts,
    wait_until,
)
from tests.tiny_models import write_tiny_model

MAX_TOKENS, LONG_TOKENS = 24, 300
# a killed router's streams ask for this many: unaborted they would run for tens of seconds on
# the decode worker, so blocks free within 10 s of the kill are the owner lease's doing
CONTEXT = 4096
ORPHAN_TOKENS = CONTEXT - 64
PER_PROCESS = 6  # long streams on each router process in the kill test
TOKEN = "router-processes-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-4k"), "llama", seed=1,
                            max_position_embeddings=CONTEXT)


@dataclass(frozen=True)
class Front:
    """How a client reaches the service: its address, the CA to verify it by."""

    address: str
    http_url: str
    ca: str

    def channel(self) -> grpc.aio.Channel:
        """A connection of its own (no subchannel shared with other channels)."""
        credentials = grpc.ssl_channel_credentials(Path(self.ca).read_bytes())
        return grpc.aio.secure_channel(self.address, credentials,
                                       options=[("grpc.use_local_subchannel_pool", 1)])


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return write_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def service(ray_cluster, model_dir, pki, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    settings = tiny_settings(model_dir, ray_cluster.address, mode="colocated",
                             decode_workers=1, max_model_len=CONTEXT, num_kv_blocks=2048,
                             http_port=free_port(), router_processes=2,
                             tls_cert=pki.server_cert, tls_key=pki.server_key,
                             api_token_file=str(tokens))
    with running(settings) as service:
        yield service


@pytest.fixture(scope="module")
def front(service, pki) -> Front:
    return Front(service.address, service.http_url, pki.ca)


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), max_model_len=CONTEXT, num_kv_blocks=512, num_threads=1)


@pytest.fixture(scope="module")
def child(service):
    """The one other router process's slot (its pid, request count, reports)."""
    (slot,) = service.service.router_processes.slots
    return slot


def _stream(channel: grpc.aio.Channel, *args):
    """greedy_stream with this module's API token."""
    return greedy_stream(channel, *args, metadata=AUTH)


def _run_streams(front: Front, prompts: list[list[int]], max_tokens: int, tag: str):
    """Every prompt on a connection of its own, concurrently."""
    async def one(i: int, prompt: list[int]):
        async with front.channel() as channel:
            return await _stream(channel, f"{tag}-{i}", prompt, max_tokens)

    async def run():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return asyncio.run(run())


async def _connections_per_process(service, front: Front, count: int, most: int = 60):
    """`count` connections served by the service process and `count` by the other, told
    apart by a one-token probe on each: did the service process's router receive it?"""
    parent = service.router
    sides: dict[bool, list[grpc.aio.Channel]] = {True: [], False: []}
    for i in range(most):
        channel, before = front.channel(), parent.num_received
        assert (await _stream(channel, f"probe-{i}", [5, 6, 7], 1))[0] == "length"
        side = sides[parent.num_received > before]
        if len(side) < count:
            side.append(channel)
        else:
            await channel.close()
        if all(len(side) == count for side in sides.values()):
            return sides[True], sides[False]
    raise AssertionError(f"{most} connections did not reach both router processes")


async def _stats(channel: grpc.aio.Channel, metadata=AUTH) -> pdserve_pb2.Stats:
    return await pdserve_pb2_grpc.InferenceStub(channel).GetStats(
        pdserve_pb2.GetStatsRequest(), timeout=5, metadata=metadata)


def _blocks_free(front: Front) -> bool:
    async def stats():
        async with front.channel() as channel:
            return await _stats(channel)
    return all(w.num_used_blocks == 0 and w.up for w in asyncio.run(stats()).workers)


def _scrape(service) -> bytes:
    url = f"http://127.0.0.1:{service.service.metrics_port}/metrics"
    return urllib.request.urlopen(url, timeout=5).read()


def _ok(text: bytes) -> float:
    return sample_value(text, "pdserve_requests_total", {"status": "ok"})


def test_concurrent_clients_get_the_offline_greedy_tokens_from_both_processes(
        service, front, offline, child):
    parent = service.router
    before_parent, before_child = parent.num_received, child.num_received
    prompts = token_prompts(16, seed=1)
    expected = offline_greedy(offline, prompts, MAX_TOKENS)
    got = _run_streams(front, prompts, MAX_TOKENS, "greedy")
    assert got == [("length", tokens) for tokens in expected]
    # each stream was received by exactly one process, and each process took some
    wait_until(lambda: parent.num_received - before_parent
               + child.num_received - before_child == len(prompts), 5,
               "the child's report counts the streams it served")
    assert parent.num_received > before_parent and child.num_received > before_child
    # the OpenAI front on the shared HTTP port: a connection per request, the same tokens
    model = parent.model.name
    text = offline.tokenizer.decode(expected[0])
    body = {"model": model, "prompt": prompts[0], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    for headers, status in [({"authorization": f"Bearer {TOKEN}"}, 200), ({}, 401)] * 4:
        with httpx.Client(timeout=60, verify=ssl.create_default_context(cafile=front.ca)) as c:
            reply = c.post(f"{front.http_url}/v1/completions", json=body, headers=headers)
        assert reply.status_code == status, reply.text
        if status == 200:
            assert reply.json()["choices"][0]["text"] == text


def test_worker_table_changes_reach_the_other_process(service, front):
    """The service process's router owns the worker table; the other router follows it."""
    router, extra = service.router, "decode-extra"

    async def workers(channel: grpc.aio.Channel) -> set[str]:
        return {w.worker_id for w in (await _stats(channel)).workers}

    async def run():
        (on_parent,), (on_child,) = await _connections_per_process(service, front, 1)
        await on_parent.close()
        assert extra not in await workers(on_child)
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # the child checks tokens too
            await _stats(on_child, metadata=())
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # a worker nobody answers at: registered, then drained away, as the planner would
        await asyncio.to_thread(service.run, router.add_worker(extra, "decode", "127.0.0.1:9"))
        end = time.monotonic() + 5
        while extra not in await workers(on_child):
            assert time.monotonic() < end, "the other router never registered the worker"
            await asyncio.sleep(0.05)
        await asyncio.to_thread(service.run, router.drain(extra, 10))
        # drain returns once every router has drained it
        assert extra not in await workers(on_child)
        await on_child.close()

    asyncio.run(run())
    assert extra not in {c.worker_id for c in router.workers()}


def test_killing_one_router_process_fails_only_its_streams(service, front, offline, child):
    prompts = token_prompts(2 * PER_PROCESS, seed=2)
    expected = offline_greedy(offline, prompts[:PER_PROCESS], LONG_TOKENS)
    old_pid, generation = child.pid, child.generation

    async def run():
        on_parent, on_child = await _connections_per_process(service, front, PER_PROCESS)
        channels = on_parent + on_child
        started = [asyncio.Event() for _ in channels]
        tasks = [asyncio.create_task(_stream(
            channel, f"long-{i}", prompts[i], LONG_TOKENS if i < PER_PROCESS else ORPHAN_TOKENS,
            started[i])) for i, channel in enumerate(channels)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        assert not any(t.done() for t in tasks), "a stream ended before the kill"
        in_parent = await asyncio.to_thread(service.run, _flight_ids(service.router))
        os.kill(old_pid, signal.SIGKILL)
        killed = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for channel in channels:
            await channel.close()
        return results, in_parent, killed

    results, in_parent, killed = asyncio.run(run())
    # the probes' verdict holds for the streams: a connection stays with its process
    assert in_parent == {f"long-{i}" for i in range(PER_PROCESS)}
    assert results[:PER_PROCESS] == [("length", tokens) for tokens in expected]
    assert [reason for reason, _ in results[PER_PROCESS:]] == ["UNAVAILABLE"] * PER_PROCESS
    # the dead router's requests, thousands of tokens from their end, are aborted on the
    # decode worker (its owner lease): every block is free again within 10 s of the kill
    wait_until(lambda: _blocks_free(front), max(1.0, killed + 10 - time.monotonic()),
               "every KV block free within 10 s")
    wait_until(lambda: child.generation == generation + 1 and child.ready, 60,
               "a replacement router process serves")
    assert child.pid != old_pid
    received = child.num_received
    got = _run_streams(front, prompts, 4, "after")
    assert [reason for reason, _ in got] == ["length"] * len(prompts)
    assert [tokens for _, tokens in got[:PER_PROCESS]] == [e[:4] for e in expected]
    wait_until(lambda: child.num_received > received, 5, "the replacement served a stream")


async def _flight_ids(router) -> set[str]:
    return set(router.flights)


def test_service_metrics_count_what_every_process_served(service, front, child):
    before_all, received = _ok(_scrape(service)), child.num_received
    before_own = _ok(generate_latest(service.service.metrics.registry))
    prompts = token_prompts(16, seed=3)
    got = _run_streams(front, prompts, 4, "metrics")
    assert [reason for reason, _ in got] == ["length"] * len(prompts)
    wait_until(lambda: _ok(_scrape(service)) == before_all + len(prompts), 5,
               "the service's /metrics counts every stream, whichever process served it")
    assert child.num_received > received
    assert _ok(generate_latest(service.service.metrics.registry)) < before_own + len(prompts)


def test_an_abort_reaches_the_stream_whichever_process_took_it(service, front):
    """Abort on a connection the other process serves still finds the stream: each stream runs
    on one process, and its Abort is sent on a connection to the other (both ways)."""
    prompt = token_prompts(1, seed=4)[0]

    async def abort_across(stream_channel, abort_channel, request_id: str):
        started = asyncio.Event()
        task = asyncio.create_task(_stream(stream_channel, request_id, prompt, ORPHAN_TOKENS,
                                           started))
        await asyncio.wait_for(started.wait(), 60)
        reply = await pdserve_pb2_grpc.InferenceStub(abort_channel).Abort(
            pdserve_pb2.AbortRequest(request_id=request_id), timeout=20, metadata=AUTH)
        return reply.found, await asyncio.wait_for(task, 30)

    async def run():
        (parent,), (child,) = await _connections_per_process(service, front, 1)
        try:
            return [await abort_across(parent, child, "abort-on-parent"),
                    await abort_across(child, parent, "abort-on-child")]
        finally:
            await parent.close()
            await child.close()

    for found, (reason, tokens) in asyncio.run(run()):
        assert found
        assert reason == "abort" and len(tokens) < ORPHAN_TOKENS
    wait_until(lambda: _blocks_free(front), 10, "the aborted requests' blocks are free")


def test_a_client_with_several_connections_is_served_by_both_processes(service, front, child):
    """AsyncClient(connections=8), as `pdserve bench --connections 8` uses it: its streams take
    turns over 8 TCP connections, which the kernel spreads over both router processes."""
    from pdserve.client import AsyncClient, ClientTLS

    time.sleep(2 * REPORT_S)  # the child's reports of earlier tests' requests are in
    parent, received = service.router, child.num_received
    parent_before = parent.num_received

    async def run():
        async with AsyncClient(front.address, api_token=TOKEN, tls=ClientTLS(ca=front.ca),
                               connections=8) as client:
            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            return await asyncio.gather(*(client.complete(p, sampling=params)
                                          for p in token_prompts(16, seed=5)))

    done = asyncio.run(run())
    assert [len(c.token_ids) for c in done] == [2] * 16
    wait_until(lambda: child.num_received > received, 5, "the child served some of them")
    assert parent.num_received > parent_before  # and the service process others


def test_a_drain_finishes_both_processes_streams_and_turns_newcomers_away(service, front,
                                                                          offline):
    """The last test: it drains the module's service, as `pdserve up` does on SIGTERM
    (tests/e2e/test_cli.py sends the signal). The streams running on either process finish
    with every token; meanwhile both fail health and answer a new request UNAVAILABLE."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    prompts = token_prompts(4, seed=7)
    expected = offline_greedy(offline, prompts, LONG_TOKENS)
    late = itertools.count()

    async def refused(channel: grpc.aio.Channel) -> bool:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5)
        code, _ = await _stream(channel, f"late-{next(late)}", [5, 6, 7], 1)
        return health.status == health_pb2.HealthCheckResponse.NOT_SERVING and \
            code == "UNAVAILABLE"

    async def run():
        on_parent, on_child = await _connections_per_process(service, front, 2)
        channels = on_parent + on_child
        started = [asyncio.Event() for _ in channels]
        tasks = [asyncio.create_task(_stream(channel, f"drained-{i}", prompts[i], LONG_TOKENS,
                                             started[i]))
                 for i, channel in enumerate(channels)]
        await asyncio.gather(*(event.wait() for event in started))
        drain = asyncio.create_task(asyncio.to_thread(service.run, service.service.drain(60)))
        for channel in (on_parent[0], on_child[0]):  # a new call on each process's connection
            end = time.monotonic() + 5
            while not await refused(channel):
                assert time.monotonic() < end, "a router process still takes new requests"
        in_flight = sum(not task.done() for task in tasks)
        got = await asyncio.gather(*tasks)
        left = await drain
        for channel in channels:
            await channel.close()
        return in_flight, got, left

    in_flight, got, left = asyncio.run(run())
    assert got == [("length", tokens) for tokens in expected]
    assert left == 0
    assert in_flight > 0, "every stream had ended before the refusals: no drain seen"
