"""Liveness is not load (issue 16, findings 11 and 13, router side).

A decode worker whose output stream goes silent (its engine loop wedged, its process
stopped) ends every request on it UNAVAILABLE within `outputs_silence_s` and comes back when
it speaks again; the supervisor's `mark_down` ends them at once; a worker whose load polls
answer late but whose stream is alive stays in rotation and serves. The silent and slow
workers are scripted gRPC servers (the router is what is under test); `mark_down` runs
against the real service.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from pdserve.client import AsyncClient, PdserveError
from pdserve.cluster_secret import ClusterSecret
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.workers import LOAD_TIMEOUT_S, WorkerLost
from tests.e2e.harness import stats, wait_until
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
SILENCE_S = 1.5
MARGIN_S = 3.0  # scheduling slack on a loaded 2-core machine


@contextlib.asynccontextmanager
async def isolated(model, decode: FakeDecode, d_addr: str, p_addr: str):
    router = make_router(model, SECRET, outputs_silence_s=SILENCE_S)
    await router.add_worker("prefill-0", "prefill", p_addr)
    await router.add_worker(decode.worker_id, "decode", d_addr)
    try:
        await router.wait_ready(10)
        yield router
    finally:
        await router.close()


def test_silent_output_stream_fails_its_requests_then_recovers(model):
    decode, prefill = FakeDecode(), FakePrefill()

    async def scenario(d_addr, p_addr):
        async with isolated(model, decode, d_addr, p_addr) as router:
            client = router.decode[decode.worker_id]
            decode.silent.set()  # a wedged engine loop: RPCs answer, the stream says nothing
            started = time.monotonic()
            with pytest.raises(WorkerLost):
                await asyncio.wait_for(collect(router, request()), SILENCE_S + MARGIN_S)
            took = time.monotonic() - started
            assert not client.up and client.num_open == 0
            decode.silent.clear()  # the loop comes round again
            await router.wait_ready(SILENCE_S + MARGIN_S)
            messages = await asyncio.wait_for(collect(router, request("after")), 10)
            return took, messages

    with serving(decode, SECRET) as d_addr, serving(prefill, SECRET) as p_addr:
        took, messages = asyncio.run(scenario(d_addr, p_addr))
    assert took <= SILENCE_S + MARGIN_S
    assert [t for m in messages for t in m.token_ids] == list(TOKENS)


def test_a_worker_marked_down_comes_back_only_on_a_fresh_stream(model):
    """Issue 39, readmission: a worker marked down (here as a failed load poll would) while its
    output stream has stalled, not broken (a network cut), must not come back on the next good
    load poll: the old stream had delivered, but it says nothing now and a request placed on
    it would fail at its silence timer. Its stream is torn down; a fresh one must deliver."""
    decode, prefill = FakeDecode(), FakePrefill()

    async def scenario(d_addr, p_addr):
        async with isolated(model, decode, d_addr, p_addr) as router:
            client = router.decode[decode.worker_id]
            decode.silent.set()  # the stream stalls ...
            client.mark_down("GetLoad: UNAVAILABLE")  # ... and a poll found the worker gone
            polls_before = decode.loads_answered
            end = time.monotonic() + SILENCE_S * 0.8  # polls answer, the silence timer waits
            while time.monotonic() < end:
                assert not client.up, "back in rotation on the stalled stream"
                await asyncio.sleep(0.05)
            polls_answered = decode.loads_answered - polls_before
            decode.silent.clear()  # a stream delivers again
            await router.wait_ready(SILENCE_S + MARGIN_S)
            messages = await asyncio.wait_for(collect(router, request("after")), 10)
            return polls_answered, messages

    with serving(decode, SECRET) as d_addr, serving(prefill, SECRET) as p_addr:
        polls_answered, messages = asyncio.run(scenario(d_addr, p_addr))
    assert polls_answered >= 2  # the load polls did answer meanwhile
    assert [t for m in messages for t in m.token_ids] == list(TOKENS)


def test_a_prefill_worker_marked_down_releases_its_prompts_at_once(model):
    """A stopped prefill process holds its connection open until it is killed: the prompts on
    it must not wait for their KV deadline once the supervisor has said it is dead."""
    decode, prefill = FakeDecode(), FakePrefill()
    deadline_s = 30.0

    async def scenario(d_addr, p_addr):
        router = make_router(model, SECRET, kv_transfer_timeout_s=deadline_s)
        await router.add_worker("prefill-0", "prefill", p_addr)
        await router.add_worker(decode.worker_id, "decode", d_addr)
        try:
            await router.wait_ready(10)
            prefill.hang.set()
            task = asyncio.create_task(collect(router, request()))
            await asyncio.wait_for(_until(lambda: prefill.requests), 5)
            started = time.monotonic()
            router.mark_down("prefill-0")
            with pytest.raises(WorkerLost):
                await asyncio.wait_for(task, deadline_s)
            return time.monotonic() - started, router.decode[decode.worker_id].num_open
        finally:
            prefill.hang.clear()
            await router.close()

    with serving(decode, SECRET) as d_addr, serving(prefill, SECRET) as p_addr:
        took, num_open = asyncio.run(scenario(d_addr, p_addr))
    assert took < MARGIN_S, took  # not the 30 s KV deadline
    assert decode.aborted == decode.reserved and num_open == 0  # its reservation was freed


def test_a_decode_worker_marked_down_releases_the_prompts_pushing_to_it(model):
    """A prompt whose KV is on its way to a decode worker the supervisor has said is dead must
    not wait for the prefill worker's push to give up: it goes to another decode worker at
    once, and the dead one's reservation is aborted."""
    dead, other, prefill = FakeDecode("decode-0"), FakeDecode("decode-1"), FakePrefill()
    deadline_s = 30.0

    async def scenario(dead_addr, other_addr, p_addr):
        router = make_router(model, SECRET, kv_transfer_timeout_s=deadline_s)
        await router.add_worker("prefill-0", "prefill", p_addr)
        await router.add_worker(dead.worker_id, "decode", dead_addr)
        try:
            await router.wait_ready(10)
            prefill.hang.set()
            task = asyncio.create_task(collect(router, request()))
            await asyncio.wait_for(_until(lambda: prefill.requests), 5)
            await router.add_worker(other.worker_id, "decode", other_addr)
            await asyncio.wait_for(_until(lambda: router.decode[other.worker_id].in_rotation), 5)
            started = time.monotonic()
            router.mark_down(dead.worker_id)
            # the prompt is given up on the dead worker and prefilled again for the other,
            # while the first Prefill still hangs
            await asyncio.wait_for(_until(lambda: len(prefill.requests) == 2), deadline_s)
            took = time.monotonic() - started
            prefill.hang.clear()
            return took, await asyncio.wait_for(task, 10)
        finally:
            prefill.hang.clear()
            await router.close()

    with serving(dead, SECRET) as dead_addr, serving(other, SECRET) as other_addr, \
            serving(prefill, SECRET) as p_addr:
        took, messages = asyncio.run(scenario(dead_addr, other_addr, p_addr))
    assert took < MARGIN_S, took  # not the 30 s KV deadline
    assert [t for m in messages for t in m.token_ids] == list(TOKENS)
    assert dead.aborted == dead.reserved and len(dead.reserved) == 1  # freed there
    assert len(other.reserved) == 1 and not other.aborted  # served there


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def test_slow_load_polls_keep_a_live_worker_in_rotation(model):
    decode, prefill = FakeDecode(), FakePrefill()

    async def scenario(d_addr, p_addr):
        async with isolated(model, decode, d_addr, p_addr) as router:
            client = router.decode[decode.worker_id]
            decode.load_delay_s = LOAD_TIMEOUT_S + 1.0  # every poll now times out
            await asyncio.sleep(2 * (LOAD_TIMEOUT_S + 1.0))
            in_rotation, stale = client.in_rotation, client.load_stale
            done = [await asyncio.wait_for(collect(router, request(f"r{i}")), 10)
                    for i in range(5)]
            return in_rotation, stale, done

    with serving(decode, SECRET) as d_addr, serving(prefill, SECRET) as p_addr:
        in_rotation, stale, done = asyncio.run(scenario(d_addr, p_addr))
    assert stale  # the polls did time out
    assert in_rotation
    assert all([t for m in ms for t in m.token_ids] == list(TOKENS) for ms in done)


@pytest.fixture(scope="module")
def service(tiny_service):
    return tiny_service  # the package's (tests/faults/conftest.py)


def test_mark_down_ends_every_request_on_the_worker_at_once(service, quiescent):
    params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)

    async def stream(client, i, started):
        try:
            async for _ in client.generate([3, 4, 5, i], sampling=params):
                started.set()
            return "ok"
        except PdserveError as exc:
            return exc.code.name

    async def run():
        async with AsyncClient(service.address, timeout=120) as client:
            events = [asyncio.Event() for _ in range(4)]
            tasks = [asyncio.create_task(stream(client, i, e)) for i, e in enumerate(events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            router = service.router
            service.loop.call_soon_threadsafe(router.mark_down, "decode-0")
            begun = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return results, time.monotonic() - begun

    results, took = asyncio.run(run())
    assert results == ["UNAVAILABLE"] * 4
    assert took < 2.0
    # the supervisor's word is final for that process (the supervisor is replacing it): alive
    # and answering, it stays out of rotation until a worker is registered under its id
    # again, as the supervisor's on_up does (here the same process, at its address)
    router = service.router
    time.sleep(1.0)  # several load polls answered
    assert not router.decode["decode-0"].up
    service.run(router.add_worker("decode-0", "decode", router.decode["decode-0"].address))
    wait_until(lambda: all(w.up for w in stats(service.address).workers), 10, "decode-0 back")
    quiescent(service, 2, 10)
