"""LLMEngine when a step brings several tokens (speculative decoding, coalesced steps) and a
stop string completes mid-step: token ids, logprobs and text end where one token per step
ends them. The tiny model runs for real; its core's steps are merged k at a time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.scheduler_output import EngineCoreOutput


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), num_threads=2, kv_cache_memory_bytes=32 << 20)


def merged(core_step, k: int):
    """`core_step` with each request's news from up to k steps delivered as one output."""
    def step() -> list[EngineCoreOutput]:
        news: dict[str, EngineCoreOutput] = {}
        for _ in range(k):
            for out in core_step():
                old = news.get(out.request_id)
                news[out.request_id] = out if old is None else replace(
                    out, new_token_ids=old.new_token_ids + out.new_token_ids,
                    new_logprobs=old.new_logprobs + out.new_logprobs)
            if any(out.finish_reason for out in news.values()):
                break
        return list(news.values())
    return step


def run(engine: LLMEngine, params: SamplingParams) -> RequestOutput:
    engine.add_request("r", "The", params)
    while True:
        (out,) = engine.step()
        if out.finished:
            return out


@pytest.mark.parametrize("k", [2, 3, 5, 16])
def test_stop_string_mid_step_cuts_token_ids_and_logprobs(llm, monkeypatch, k: int) -> None:
    engine = llm.engine
    free = run(engine, SamplingParams(temperature=0, max_tokens=16))
    stop = free.text[len(free.text) // 2 :][:3]
    assert stop, "the tiny model produced no text to stop on"
    params = SamplingParams(temperature=0, max_tokens=16, stop=[stop], logprobs=0)
    one_by_one = run(engine, params)
    assert (one_by_one.finish_reason, one_by_one.stop_reason) == ("stop", stop)
    assert len(one_by_one.token_ids) < len(free.token_ids)  # tokens did follow the stop
    monkeypatch.setattr(engine.core, "step", merged(engine.core.step, k))
    several = run(engine, params)
    assert (several.finish_reason, several.stop_reason) == ("stop", stop)
    assert several.text == one_by_one.text == free.text[: free.text.index(stop)]
    assert several.token_ids == one_by_one.token_ids == free.token_ids[: len(several.token_ids)]
    assert several.logprobs == one_by_one.logprobs
    assert len(several.logprobs) == len(several.token_ids)
    assert not engine.has_unfinished_requests()
    assert engine.core.kv_cache.num_free_blocks == engine.config.cache.num_blocks
