"""AsyncLLMEngine: concurrent streams, per-step deltas, abort and early exit free blocks."""

from __future__ import annotations

import asyncio

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.async_engine import AsyncLLMEngine


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), num_threads=2, kv_cache_memory_bytes=32 << 20)


def test_streams_match_offline_and_deltas_add_up(llm):
    prompts = ["Hello", "The capital of France", "1 2 3 4", "Once upon"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    offline = llm.generate(prompts, params)

    async def main():
        engine = AsyncLLMEngine(llm.engine)

        async def consume(i, prompt):
            await asyncio.sleep(0.01 * i)  # arrive at different steps
            deltas, text, last = [], "", None
            async for out in engine.generate(prompt, params, request_id=f"s{i}"):
                deltas.extend(out.delta_token_ids)
                text += out.delta_text
                last = out
            return deltas, text, last

        results = await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts)))
        await engine.shutdown()
        return results

    for (deltas, text, last), ref in zip(asyncio.run(main()), offline):
        assert deltas == last.token_ids == ref.token_ids
        assert text == last.text == ref.text
        assert last.finished and last.finish_reason == "length"


def test_abort_and_early_exit_free_every_block(llm):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        engine = AsyncLLMEngine(llm.engine)
        aborted = engine.add_request("a", "abort me", params)
        outputs = []
        async for out in aborted:
            outputs.append(out)
            if len(outputs) == 3:
                engine.abort("a")
        async for out in engine.generate("leave early", params, request_id="b"):
            if len(out.token_ids) >= 2:
                break  # the generator's cleanup aborts the request
        await asyncio.sleep(0)
        for _ in range(100):  # the abort runs on the engine's loop thread, at a step boundary
            if not llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.02)
        await engine.shutdown()
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert len(outputs[-1].token_ids) < 200
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == llm.config.cache.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_bad_input_raises_before_queueing(llm):
    async def main():
        engine = AsyncLLMEngine(llm.engine)
        with pytest.raises(ValueError, match="prompt"):
            engine.add_request("x", "", SamplingParams())
        with pytest.raises(ValueError, match="prompt_token_ids"):
            engine.add_request("y", [10**9], SamplingParams())
        # nothing was queued: the same ids are free, and only the good requests run
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for rid in ("x", "y"):
            outs = [out async for out in engine.add_request(rid, "fine now", params)]
            assert outs[-1].finished and len(outs[-1].token_ids) == 2
        await engine.shutdown()

    asyncio.run(main())
    assert not llm.engine.has_unfinished_requests()


def test_a_dead_loop_fails_every_stream_and_later_calls(llm):
    """A step that raises ends every open stream with the reason; nothing hangs after."""
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

    async def main():
        engine = AsyncLLMEngine(llm.engine)
        step, calls = llm.engine.step, [0]

        def failing_step():
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("the model fell over")
            return step()

        llm.engine.step = failing_step
        try:
            streams = [engine.add_request(f"d{i}", "doomed", params) for i in range(2)]
            for stream in streams:
                with pytest.raises(RuntimeError, match="fell over"):
                    async for _ in stream:
                        pass
            with pytest.raises(RuntimeError, match="died"):
                engine.add_request("late", "too late", params)
            await engine.shutdown()
        finally:
            del llm.engine.step
        for rid in ("d0", "d1"):  # the engine is the caller's again: free what it held
            llm.engine.abort(rid)

    asyncio.run(main())
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.kv_cache.num_free_blocks == llm.config.cache.num_blocks
