"""Issue 42, per-request placement: while the prefill worker is busy, adaptive placement has the
decode worker prefill the next prompt itself, between its decode steps, instead of queueing
it behind the prefill worker; both requests' greedy tokens are the offline engine's, the
decision and its predicted TTFT are exported, and nothing is left on either worker.

Real parts in this process: one prefill and one decode worker behind their authenticated gRPC
servers (KV over gloo on 127.0.0.1) and the real Router. The prefill worker is made busy, not
slow, deterministically: a command holds its engine loop until the test lets go, so its queue
(the router's count of the tokens sent there) grows while it computes nothing. Its load
reports still come (read off the loop thread). The tiny model's cost per token is lost in
timing noise (a fit over a few steps can come out with a negative slope), so the prefill
worker's step-time model is a fixed line, as it reports it; the decode worker, whose steps
were all one token so far, has no slope fitted and is priced at that line.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.step_budget import StepFit
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.router import Router
from pdserve.router.validation import ModelContext, ValidRequest
from tests.workers.pd import SECRET

CALL_S = 60.0
MAX_TOKENS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
QUEUED = list(range(1000, 1400))  # held at the prefill worker: 400 tokens queued there
NEXT = list(range(2000, 2100))  # 100 tokens: sooner on the idle decode worker


class FixedLine:
    """A step-time model that has fitted 2 ms + 0.5 ms a token and learns nothing more."""

    slope_fitted, decode_slope_fitted = True, False

    def observe(self, num_tokens: int, seconds: float, num_decodes: int = 0) -> None:
        pass

    def fit(self) -> StepFit:
        return StepFit(0.002, 0.0005)


@pytest.fixture(scope="module")
def fixed_plane(plane):
    """The module's plane, its prefill worker's step times on a fixed line."""
    plane[0].worker.core.scheduler.step_time = FixedLine()
    return plane


def sample(metrics: RouterMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def tokens(router: Router, rid: str, prompt: list[int]) -> list[int]:
    req = ValidRequest(rid, tuple(prompt), GREEDY, "")
    return [t async for m in router.generate(req, time.monotonic()) for t in m.token_ids]


async def run(model, plane, metrics: RouterMetrics):
    prefill, decode = plane
    router = Router(model, RouterConfig(), metrics, secret=SECRET)
    gate = threading.Event()
    try:
        await router.add_worker("prefill-0", "prefill", prefill.address)
        await router.add_worker("decode-0", "decode", decode.address)
        await router.wait_ready(CALL_S)
        client = router.prefill["prefill-0"]
        held = prefill.worker._loop.submit(gate.wait)  # its loop runs nothing until set
        queued = asyncio.ensure_future(tokens(router, "queued", QUEUED))
        while client.num_inflight_tokens < len(QUEUED):
            await asyncio.sleep(0.01)
        local = await asyncio.wait_for(tokens(router, "next", NEXT), CALL_S)
        still_queued = not queued.done()
        gate.set()
        held.result(CALL_S)
        return await asyncio.wait_for(queued, CALL_S), local, still_queued
    finally:
        gate.set()
        await router.close()


def test_a_busy_prefill_worker_sends_the_next_prompt_to_the_decode_worker(tiny_llama_dir,
                                                                         fixed_plane):
    model = ModelContext.load(str(tiny_llama_dir), "tiny", max_model_len=512)
    metrics = RouterMetrics()
    queued, local, still_queued = asyncio.run(run(model, fixed_plane, metrics))
    # the second prompt finished while the first still waited at the prefill worker
    assert still_queued
    offline = LLM(str(tiny_llama_dir), max_model_len=512, num_kv_blocks=64, num_threads=1)
    expected = [o.token_ids for o in offline.generate([QUEUED, NEXT], GREEDY)]
    assert [queued, local] == expected
    placements = "pdserve_prefill_placements_total"
    assert sample(metrics, placements, where="local", reason="sooner") == 1
    # the held prompt went remote: no sooner on the decode worker (a tie spares it)
    assert sample(metrics, placements, where="remote", reason="sooner") == 1
    assert sample(metrics, "pdserve_predicted_ttft_seconds_count", where="local") == 1
    prefill, decode = fixed_plane
    stats = decode.worker.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_reserved == 0
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert prefill.worker.stats().num_waiting == 0
