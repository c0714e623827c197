"""Issue 42, admission with foresight: with `early_rejection` and a TTFT SLO, a request every
prefill worker is predicted to miss the SLO for is refused at once — RESOURCE_EXHAUSTED with
gRPC's retry pushback over gRPC, 429 with `Retry-After` over HTTP — holding nothing on any
worker; before the prefill worker's rate is measured, requests are admitted.

Real parts in this process: a prefill and a decode worker behind their authenticated gRPC
servers (KV over gloo on 127.0.0.1), the real Router, and its real fronts (RouterServer and the
OpenAI HTTPServer) on 127.0.0.1 ports, driven by a gRPC stub and an HTTP client. The SLO is far
below what any prompt can take (a microsecond), so once the rate is measured every prediction
misses it, whatever the machine.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc
import httpx
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai.app import OpenAIApp
from pdserve.router.openai.server import HTTPServer
from pdserve.router.placement import TTFTUnmeetable
from pdserve.router.router import Router
from pdserve.router.server import RouterServer
from pdserve.router.validation import ModelContext, ValidRequest
from tests.workers.pd import SECRET

CALL_S = 60.0
SLO_S = 1e-6
PROMPT = list(range(300, 340))


def request(i: int) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        request_id=f"r{i}", prompt_token_ids=[t + i for t in PROMPT],
        sampling=pdserve_pb2.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))


async def generate(stub, i: int) -> tuple[str, dict[str, str]]:
    """"ok", or the status code's name, and the call's trailing metadata."""
    call = stub.Generate(request(i), timeout=CALL_S)
    try:
        async for _ in call:
            pass
        return "ok", {}
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, dict(exc.trailing_metadata() or ())


async def serve(model, plane):
    prefill, decode = plane
    router = Router(model, RouterConfig(ttft_slo_s=SLO_S, early_rejection=True),
                    RouterMetrics(), secret=SECRET)
    await router.add_worker("prefill-0", "prefill", prefill.address)
    await router.add_worker("decode-0", "decode", decode.address)
    server = RouterServer(router, "127.0.0.1", 0, ())
    app = OpenAIApp(router, server.can_serve, ())
    http = HTTPServer(app.app, "127.0.0.1", 0)
    try:
        await router.wait_ready(CALL_S)
        await server.start()
        await http.start()
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pdserve_pb2_grpc.InferenceStub(channel)
            unmeasured = await generate(stub, 0)  # no rate yet: admitted
            end = time.monotonic() + 10.0
            while not router.prefill["prefill-0"].load.prefill_s_per_token:
                assert time.monotonic() < end, "the prefill worker's rate was never reported"
                await asyncio.sleep(0.05)
            refused = await generate(stub, 1)
            # a migrated request (its tokens already streamed) is never rejected early
            fresh = ValidRequest("r3", tuple(t + 3 for t in PROMPT),
                                 SamplingParams(max_tokens=2), "")
            migrated = replace(fresh, num_output_tokens=1)
            placer, decode = router.placer, router.decode["decode-0"]
            _, _, miss_s = await placer.choose_prefill(list(fresh.prompt_token_ids))
            with pytest.raises(TTFTUnmeetable):
                await placer._where_to_prefill(fresh, list(fresh.prompt_token_ids), decode, 0,
                                               set())
            kept, _ = await placer._where_to_prefill(
                migrated, list(migrated.prompt_token_ids), decode, 0, set())
        async with httpx.AsyncClient(timeout=CALL_S) as client:
            answer = await client.post(f"{http.url}/v1/completions", json={
                "model": "tiny", "prompt": [t + 2 for t in PROMPT], "max_tokens": 2})
        return unmeasured, refused, answer, kept.worker_id, miss_s
    finally:
        await http.stop()
        await server.stop(grace=0)
        await router.close()


def test_a_request_predicted_to_miss_the_ttft_slo_is_refused_at_once(tiny_llama_dir, plane):
    model = ModelContext.load(str(tiny_llama_dir), "tiny", max_model_len=512)
    unmeasured, (code, trailers), answer, kept, miss_s = asyncio.run(serve(model, plane))
    assert kept == "prefill-0" and miss_s > 0
    assert unmeasured == ("ok", {})
    assert code == "RESOURCE_EXHAUSTED"
    assert int(trailers["grpc-retry-pushback-ms"]) >= 1
    assert answer.status_code == 429
    assert int(answer.headers["retry-after"]) >= 1
    error = answer.json()["error"]
    assert error["type"] == "rate_limit_error" and "TTFT SLO" in error["message"]
    prefill, decode = plane  # the refused requests left nothing anywhere
    stats = decode.worker.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_reserved == 0
    assert prefill.worker.stats().num_waiting == 0
