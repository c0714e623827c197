"""Finding 7 (and the client-given sizes beside it): stop lists, ids and deadlines are capped
by the server, over both fronts, against the real RouterServer / OpenAI front (uvicorn) around
the real Router with a scriptable decode worker (`fronts_harness`).

Without caps a request carrying thousands of stop strings is accepted (and scanned on every
token on the router's loop, and re-sent in every TP plan), and a Generate whose client gave a
far deadline holds its worker for as long as the worker keeps it.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from pdserve.client import AsyncClient, PdserveError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.validation import ModelContext
from tests.faults.fronts_harness import fronts

CALL_S = 20.0
CAP_S = 1.0


@pytest.fixture(scope="module")
def model(tiny_llama_dir) -> ModelContext:
    return ModelContext.load(str(tiny_llama_dir), "tiny", max_model_len=512)


async def _outcome(client: AsyncClient, **request) -> str:
    """"ok", or the status code and message of the refusal."""
    try:
        await client.complete([1, 2, 3], **request)
        return "ok"
    except PdserveError as exc:
        return f"{exc.code.name}: {exc.message}"


def test_grpc_front_caps_stop_lists_and_ids(model):
    cases = [
        {"sampling": SamplingParams(max_tokens=4, stop=[f"s{i}" for i in range(17)])},
        {"sampling": SamplingParams(max_tokens=4, stop=["x" * 257])},
        {"sampling": SamplingParams(max_tokens=4, stop_token_ids=list(range(65)))},
        {"sampling": SamplingParams(max_tokens=4), "request_id": "r" * 129},
    ]
    at_caps = [
        {"sampling": SamplingParams(max_tokens=4, stop=[f"s{i}" for i in range(15)] + ["x" * 256],
                                    stop_token_ids=list(range(64)))},
        {"sampling": SamplingParams(max_tokens=4), "request_id": "r" * 128},
    ]

    async def main():
        async with fronts(model) as f, AsyncClient(f.address, timeout=CALL_S) as client:
            refused = [await _outcome(client, **case) for case in cases]
            accepted = [await _outcome(client, **case) for case in at_caps]
            return refused, accepted

    refused, accepted = asyncio.run(main())
    assert refused == [
        "INVALID_ARGUMENT: sampling.stop: 17 stop strings; the limit is 16",
        "INVALID_ARGUMENT: sampling.stop[0] is 257 characters; the limit is 256",
        "INVALID_ARGUMENT: sampling.stop_token_ids: 65 ids; the limit is 64",
        "INVALID_ARGUMENT: request_id is 129 characters; the limit is 128",
    ]
    assert accepted == ["ok", "ok"]


def test_openai_front_answers_400_naming_the_parameter(model):
    bodies = [
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ]

    async def main():
        async with fronts(model, http=True) as f, httpx.AsyncClient(timeout=CALL_S) as http:
            answers = []
            for extra, _ in bodies:
                reply = await http.post(f"{f.http_url}/v1/completions", json={
                    "prompt": [1, 2, 3], "max_tokens": 4, **extra})
                answers.append((reply.status_code, reply.json()["error"]["param"]))
            ok = await http.post(f"{f.http_url}/v1/completions", json={
                "prompt": [1, 2, 3], "max_tokens": 4, "stop": ["a"] * 16})
            return answers, ok.status_code

    answers, ok = asyncio.run(main())
    assert answers == [(400, param) for _, param in bodies]
    assert ok == 200


def test_grpc_generate_is_capped_by_the_server(model):
    """A decode worker that stops streaming (a wedged loop) and a client that would wait 20 s:
    the server ends the request at its own cap, DEADLINE_EXCEEDED, and frees the worker."""

    async def main():
        async with fronts(model, max_timeout_s=CAP_S) as f:
            f.decode.silent.set()
            async with AsyncClient(f.address, timeout=CALL_S) as client:
                start = time.monotonic()
                with pytest.raises(PdserveError) as info:
                    await client.complete([1, 2, 3], request_id="capped",
                                          sampling=SamplingParams(max_tokens=4))
                elapsed = time.monotonic() - start
            end = time.monotonic() + 5.0
            while not any(r.startswith("capped") for r in f.decode.aborted):
                assert time.monotonic() < end, "the worker was never told to free the request"
                await asyncio.sleep(0.05)
            return info.value, elapsed, dict(f.router.flights)

    error, elapsed, flights = asyncio.run(main())
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "server's limit of 1 s" in error.message
    assert CAP_S <= elapsed < CAP_S + 3.0
    assert flights == {}
