"""Router races and retries (issue 16, findings 8, 9 and the router side of 10).

8 and 9 run against the real service (Ray workers, Redis, gRPC router): an Abort during
placement must end the request "abort" with nothing held; a request_id reused right after a
cancel must be a new request. 10 isolates the router against scripted worker gRPC servers
(tests.faults.router_fakes): a Start that finds its reservation expired, a Prefill whose KV
transfer the decode side failed, a worker message over the size limit, a 256-character id.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import grpc
import pytest

from pdserve.client import AsyncClient, Client
from pdserve.cluster_secret import ClusterSecret
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.descriptor import MAX_REQUEST_ID_CHARS
from pdserve.router.validation import InvalidArgument
from pdserve.router.workers import WorkerLost
from pdserve.worker_grpc import SERVER_OPTIONS
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
HOLD_S = 1.5  # how long a hooked placement step waits (the abort arrives meanwhile)


@pytest.fixture(scope="module")
def service(tiny_service):
    return tiny_service  # the package's (tests/faults/conftest.py)


def run_isolated(model, decode: FakeDecode, prefills: list[FakePrefill], scenario,
                 decode_options=SERVER_OPTIONS, **config):
    """`scenario(router)` on a real Router whose workers are the given fakes."""
    with contextlib.ExitStack() as stack:
        d_addr = stack.enter_context(serving(decode, SECRET, decode_options))
        p_addrs = [stack.enter_context(serving(p, SECRET)) for p in prefills]

        async def main():
            router = make_router(model, SECRET, **config)
            for p, address in zip(prefills, p_addrs):
                await router.add_worker(p.worker_id, "prefill", address)
            await router.add_worker(decode.worker_id, "decode", d_addr)
            try:
                await router.wait_ready(10)
                return await asyncio.wait_for(scenario(router), 30)
            finally:
                await router.close()
        return asyncio.run(main())


# ---- 10: which side a worker failure is on ----


def test_start_after_expired_reservation_is_placed_again(model):
    decode, prefill = FakeDecode(), FakePrefill()
    decode.start_not_found = 1

    async def scenario(router):
        messages = await collect(router, request())
        return messages, router.decode["decode-0"].up

    messages, up = run_isolated(model, decode, [prefill], scenario)
    assert [t for m in messages for t in m.token_ids] == list(TOKENS)
    assert messages[-1].finish_reason == "length"
    assert up  # NOT_FOUND is the reservation's fate, not the worker's
    assert len(set(decode.reserved)) == 2 and decode.reserved[0] in decode.aborted


def test_reservation_lost_every_time_is_unavailable_not_invalid(model):
    decode, prefill = FakeDecode(), FakePrefill()
    decode.start_not_found = 100

    async def scenario(router):
        with pytest.raises(WorkerLost) as caught:
            await collect(router, request())
        return caught.value, router.decode["decode-0"].up

    error, up = run_isolated(model, decode, [prefill], scenario)
    assert not isinstance(error, InvalidArgument)  # the servicer answers UNAVAILABLE
    assert up


def test_transfer_failed_by_decode_side_keeps_prefill_worker(model):
    decode, prefill = FakeDecode(), FakePrefill()
    prefill.failures = [grpc.StatusCode.ABORTED]

    async def scenario(router):
        messages = await collect(router, request())
        return messages, router.prefill["prefill-0"].up

    messages, prefill_up = run_isolated(model, decode, [prefill], scenario)
    assert [t for m in messages for t in m.token_ids] == list(TOKENS)
    assert prefill_up
    assert len(prefill.requests) == 2  # retried on the same (healthy) prefill worker


def _big_prompt() -> tuple[int, ...]:
    # 1.5 M ids of 3 varint bytes each: a 4.5 MB Reserve, over gRPC's default 4 MiB
    return (40000,) * 1_500_000


def test_worker_message_over_the_size_limit_is_the_requests_fault(model):
    decode, prefill = FakeDecode(), FakePrefill()
    default_limits = (("grpc.max_receive_message_length", 4 * 1024 * 1024),)

    async def scenario(router):
        with pytest.raises(InvalidArgument):
            await collect(router, request(prompt=_big_prompt()))
        await asyncio.sleep(0.5)  # a poll or two later: still in rotation
        return router.decode["decode-0"].in_rotation

    assert run_isolated(model, decode, [prefill], scenario, decode_options=default_limits)


def test_message_near_4mib_reaches_a_64mib_worker(model):
    decode, prefill = FakeDecode(), FakePrefill()

    async def scenario(router):
        return await collect(router, request(prompt=_big_prompt()))

    messages = run_isolated(model, decode, [prefill], scenario)
    assert messages[-1].finish_reason == "length"


def test_retry_ids_of_a_256_character_request_id_fit_a_descriptor(model):
    decode, prefills = FakeDecode(), [FakePrefill("prefill-0"), FakePrefill("prefill-1")]
    prefills[0].failures = [grpc.StatusCode.INTERNAL]  # lost mid-prompt: retried elsewhere

    async def scenario(router):
        return await collect(router, request("x" * MAX_REQUEST_ID_CHARS))

    messages = run_isolated(model, decode, prefills, scenario)
    assert messages[-1].finish_reason == "length"
    assert len(decode.reserved) == 2 and len(set(decode.reserved)) == 2
    assert all(len(rid) <= MAX_REQUEST_ID_CHARS for rid in decode.reserved), decode.reserved


# ---- 8: an Abort during placement ----


def _hook(service, where: str, entered: threading.Event):
    """Make one placement step wait HOLD_S before it goes on; returns the undo."""
    router = service.router
    owner = router.placer if where == "choose_prefill" else router.decode["decode-0"]
    name = "choose_prefill" if where == "choose_prefill" else "reserve"
    real = getattr(owner, name)

    async def slow(*args, **kwargs):
        entered.set()
        await asyncio.sleep(HOLD_S)
        return await real(*args, **kwargs)

    setattr(owner, name, slow)
    return lambda: delattr(owner, name)


@pytest.mark.parametrize("where", ["choose_prefill", "reserve"])
def test_abort_during_placement_ends_abort_and_holds_nothing(service, quiescent, where):
    entered, chunks = threading.Event(), []
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    undo = _hook(service, where, entered)
    try:
        with Client(service.address, timeout=60) as client:
            reader = threading.Thread(target=lambda: chunks.extend(client.generate(
                [5, 6, 7] * 6, sampling=params, request_id=f"abort-{where}")))
            reader.start()
            assert entered.wait(30), "placement never reached the hook"
            assert client.abort(f"abort-{where}") is True
            reader.join(30)
            assert not reader.is_alive()
    finally:
        undo()
    assert chunks and chunks[-1].finish_reason == "abort", chunks
    assert sum(len(c.token_ids) for c in chunks) == 0
    quiescent(service, 2, 10)
    assert service.router.decode["decode-0"].num_open == 0


# ---- 9: a request_id reused right after a cancel ----


def test_request_id_reused_right_after_cancel_is_a_new_request(service, quiescent):
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [21, 22, 23, 24, 25]

    async def run():
        async with AsyncClient(service.address, timeout=60) as client:
            expected = await client.complete(prompt, sampling=greedy, request_id="fresh")
            got = []
            for i in range(5):
                stream = client.generate([31, 32, i], sampling=long, request_id="reused")
                async for _ in stream:
                    break  # the first chunk is out: the request runs on the decode worker
                await stream.aclose()  # cancels the RPC
                got.append(await client.complete(prompt, sampling=greedy, request_id="reused"))
            return expected, got

    expected, got = asyncio.run(run())
    for completion in got:
        assert completion.finish_reason == "length"
        assert completion.token_ids == expected.token_ids
    quiescent(service, 2, 10)
