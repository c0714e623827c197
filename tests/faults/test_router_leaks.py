"""Nothing of a request outlives it in the router (issue 16, finding 4).

Against the real service (Ray workers, Redis, gRPC router): a randomized mix of requests that
finish, stop at a stop string, are cancelled by the client or aborted; afterwards the decode
client's per-request output queues and the router's flights are back to zero and no worker
holds a block.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from pdserve.client import AsyncClient
from pdserve.engine.sampling_params import SamplingParams
from tests.e2e.harness import wait_until

NUM_REQUESTS = 40
CONCURRENCY = 8


@pytest.fixture(scope="module")
def service(tiny_service):
    return tiny_service  # the package's (tests/faults/conftest.py)


def open_queues(service) -> int:
    return sum(c.num_open for c in service.router.decode.values())


async def _stop_string(client: AsyncClient, prompt: list[int]) -> str:
    """A piece of the greedy answer's text: a stop string the answer is sure to reach."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    text = (await client.complete(prompt, sampling=greedy)).text
    middle = text[len(text) // 2:len(text) // 2 + 3]
    assert middle.strip() and "\ufffd" not in middle, text
    return middle


async def _one(client: AsyncClient, kind: str, i: int, prompt: list[int], stop: str) -> str:
    rid = f"leak-{i}"
    if kind == "finish":
        params = SamplingParams(temperature=0.7, seed=i, max_tokens=4 + i % 8, ignore_eos=True)
        return (await client.complete([7, i, 9], sampling=params, request_id=rid)).finish_reason
    if kind == "stop":
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, stop=[stop])
        return (await client.complete(prompt, sampling=params, request_id=rid)).finish_reason
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stream = client.generate([8, i, 10], sampling=params, request_id=rid)
    last = None
    async for chunk in stream:
        last = chunk.finish_reason
        if kind == "cancel":
            break
        if kind == "abort" and last is None:
            kind = "aborted"
            assert await client.abort(rid)
    await stream.aclose()
    return "cancel" if kind == "cancel" else last


def test_no_queue_or_flight_outlives_its_request(service, quiescent):
    rng = random.Random(16)
    kinds = [rng.choice(["finish", "stop", "cancel", "abort"]) for _ in range(NUM_REQUESTS)]
    prompt = [40, 41, 42, 43]

    async def run():
        async with AsyncClient(service.address, timeout=120) as client:
            stop = await _stop_string(client, prompt)
            gate = asyncio.Semaphore(CONCURRENCY)

            async def limited(kind, i):
                async with gate:
                    return await _one(client, kind, i, prompt, stop)

            return await asyncio.gather(*(limited(k, i) for i, k in enumerate(kinds)))

    ends = asyncio.run(run())
    expected = {"finish": "length", "stop": "stop", "cancel": "cancel", "abort": "abort"}
    assert ends == [expected[k] for k in kinds]
    assert set(kinds) == set(expected)  # every way out was taken
    wait_until(lambda: open_queues(service) == 0 and not service.router.flights, 10,
               f"no output queue ({open_queues(service)} open) nor flight left")
    quiescent(service, 2, 10)
