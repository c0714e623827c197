"""A decode worker's speculative decoding counts, from its scheduler to the router's /metrics and
GetStats and to what `pdserve bench` prints; and the config it runs with, in its start-up log.

Real parts: a decode worker built from its WorkerSpec as its actor builds it, behind its
authenticated gRPC server, and the real Router and RouterServer polling it. The counts are
set on the worker's scheduler (what its engine's verifications add to), so this checks the
plumbing whether or not the engine speculates yet.
"""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest

from pdserve.bench.speculation import speculation_between
from pdserve.client import AsyncClient
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.metrics_text import sample_value
from pdserve.router.router import Router
from pdserve.router.server import RouterServer
from pdserve.router.validation import ModelContext
from tests.faults.worker_plane import AUTH, SECRET, start_decode, worker_spec

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "model": None}
WAIT_S = 20.0


@pytest.fixture(scope="module")
def decode(tiny_llama_dir):
    service = start_decode(worker_spec(tiny_llama_dir, "decode-0", speculative_config=NGRAM),
                           SECRET)
    yield service
    service.stop()


def _count(decode, verifications: int, drafts: int, accepted: int) -> None:
    stats = decode.worker.core.scheduler.stats
    stats.num_spec_verifications, stats.num_draft_tokens = verifications, drafts
    stats.num_accepted_tokens = accepted


def test_the_worker_logs_the_config_it_speculates_with(tiny_llama_dir, caplog) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.decode_worker.service")
    service = start_decode(worker_spec(tiny_llama_dir, "decode-log", speculative_config=NGRAM),
                           SECRET)
    service.stop()
    assert service.worker.config.speculative.to_dict() == NGRAM
    (line,) = [r.getMessage() for r in caplog.records if "decode-log serving" in r.getMessage()]
    assert line.endswith(f"speculative decoding: {json.dumps(NGRAM, sort_keys=True)}"), line


def test_get_load_carries_the_counts(decode) -> None:
    _count(decode, 3, 12, 7)
    with grpc.insecure_channel(decode.address) as channel:
        load = worker_pb2_grpc.DecodeWorkerStub(channel).GetLoad(
            worker_pb2.GetLoadRequest(), metadata=AUTH, timeout=30)
    assert (load.num_spec_verifications, load.num_draft_tokens, load.num_accepted_tokens) == (
        3, 12, 7)


def test_counts_reach_the_routers_metrics_stats_and_the_bench(decode, tiny_llama_dir) -> None:
    model = ModelContext.load(str(tiny_llama_dir), "tiny", max_model_len=512)

    async def until_drafts(metrics: RouterMetrics, drafts: int) -> str:
        for _ in range(int(WAIT_S / 0.1)):
            text = metrics.render().decode()
            if sample_value(text, "pdserve_spec_draft_tokens_total") == drafts:
                return text
            await asyncio.sleep(0.1)
        raise AssertionError(f"the router never showed {drafts} draft tokens")

    async def main():
        metrics = RouterMetrics()
        router = Router(model, RouterConfig(colocated=True), metrics, secret=SECRET)
        await router.add_worker("decode-0", "decode", decode.address)
        server = RouterServer(router, "127.0.0.1", 0)
        try:
            await router.wait_ready(timeout=WAIT_S)
            await server.start()
            _count(decode, 100, 400, 250)
            before = await until_drafts(metrics, 400)  # a bench run starts: first scrape
            _count(decode, 160, 640, 400)  # what the run's verifications added
            after = await until_drafts(metrics, 640)
            async with AsyncClient(server.address, timeout=WAIT_S) as client:
                (stats,) = (await client.stats()).workers
        finally:
            await server.stop(grace=0)
        return before, after, stats

    before, after, stats = asyncio.run(main())
    assert sample_value(after, "pdserve_spec_accepted_tokens_total", {"worker": "decode-0"}) == 400
    assert sample_value(after, "pdserve_spec_verifications_total") == 160
    assert (stats.num_spec_verifications, stats.num_draft_tokens, stats.num_accepted_tokens) == (
        160, 640, 400)
    run = speculation_between(before, after)
    assert run.acceptance_rate == pytest.approx(150 / 240)
    assert run.mean_accepted_length == pytest.approx((150 + 60) / 60)
