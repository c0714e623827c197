"""Engine behaviour on a real (tiny) model: prefix reuse, bad input, seeded sampling, and
block accounting after a randomized mix of finished, aborted and preempted requests."""

from __future__ import annotations

import math
import random

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), num_threads=2, kv_cache_memory_bytes=32 << 20)


def assert_all_free(engine: LLMEngine) -> None:
    kv = engine.core.kv_cache
    assert kv.num_free_blocks == engine.config.cache.num_blocks
    assert all(kv.pool.block(i).ref_count == 0 for i in range(kv.pool.num_blocks))
    assert not engine.has_unfinished_requests()


def test_shared_prefix_computes_only_new_tokens(llm):
    prefix = random.Random(0).choices(range(3, 40000), k=256)
    first = prefix + [11, 12, 13]
    second = prefix + [21, 22, 23, 24, 25]
    llm.engine.core.kv_cache.pool.reset_prefix_cache()
    stats = llm.engine.core.scheduler.stats
    llm.generate([first], GREEDY)
    before = stats.num_computed_tokens
    (out,) = llm.generate([second], GREEDY)
    computed = stats.num_computed_tokens - before
    # new prompt tokens, then one decode step per generated token after the first
    assert out.num_cached_tokens == 256
    assert computed == (len(second) - 256) + (len(out.token_ids) - 1)
    uncached = LLM(
        model=llm.config.model.path, num_threads=2, kv_cache_memory_bytes=32 << 20,
        enable_prefix_caching=False,
    )
    assert uncached.generate([second], GREEDY)[0].token_ids == out.token_ids


BAD_INPUTS = [
    ("", {}, "prompt"),
    ([], {}, "prompt_token_ids"),
    ([1, 2, 10**9], {}, "prompt_token_ids"),
    ([-1], {}, "prompt_token_ids"),
    ("x " * 5000, {}, "max_model_len"),
    ("hi", {"max_tokens": 0}, "max_tokens"),
    ("hi", {"max_tokens": -3}, "max_tokens"),
    ("hi", {"temperature": -0.5}, "temperature"),
    ("hi", {"temperature": math.nan}, "temperature"),
    ("hi", {"top_p": 0.0}, "top_p"),
    ("hi", {"top_p": 1.5}, "top_p"),
    ("hi", {"top_k": -2}, "top_k"),
    ("hi", {"min_p": 2.0}, "min_p"),
    ("hi", {"stop_token_ids": [10**9]}, "stop_token_ids"),
]


@pytest.mark.parametrize("prompt,params,field", BAD_INPUTS)
def test_bad_input_names_the_field_and_allocates_nothing(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(["a good prompt", prompt], SamplingParams(**params))
    assert_all_free(llm.engine)


def test_unknown_model_names_the_field():
    with pytest.raises(ValueError, match="model"):
        LLM(model="no-such-model-anywhere")


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    alone = llm.generate(["Once upon a time"], seeded)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12) for _ in range(4)]
    prompts = ["Hello there", "Once upon a time", "12345", "Why is the sky blue?", "x y z"]
    batch = llm.generate(prompts, [others[0], seeded, *others[1:]])
    assert batch[1].token_ids == alone
    again = llm.generate(["Once upon a time"], seeded)[0].token_ids
    assert again == alone
    different = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=12)
    assert llm.generate(["Once upon a time"], different)[0].token_ids != alone


def test_stop_string_ends_request_and_frees_blocks(llm):
    (free_run,) = llm.generate(["The"], SamplingParams(temperature=0, max_tokens=16))
    stop = free_run.text[len(free_run.text) // 2 :][:3]
    assert stop, "the tiny model produced no text to stop on"
    (out,) = llm.generate(["The"], SamplingParams(temperature=0, max_tokens=16, stop=[stop]))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free_run.text[: free_run.text.index(stop)]
    assert_all_free(llm.engine)


def test_randomized_finish_abort_preempt_returns_every_block(tiny_llama_dir):
    rng = random.Random(7)
    llm = LLM(
        model=str(tiny_llama_dir), num_threads=2, num_kv_blocks=24, max_model_len=384,
        max_num_batched_tokens=128,
    )
    engine = llm.engine
    live, step = set(), 0
    for i in range(60):
        prompt = [rng.randrange(3, 40000) for _ in range(rng.randrange(1, 200))]
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randrange(1, 40),
            seed=rng.choice([None, i]),
        )
        engine.add_request(f"q{i}", prompt, params)
        live.add(f"q{i}")
        for _ in range(rng.randrange(0, 4)):
            live -= {o.request_id for o in engine.step() if o.finished}
            step += 1
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            assert engine.abort(victim).finish_reason == "abort"
            live.discard(victim)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.scheduler.stats.num_preemptions > 0
    assert engine.abort("q0") is None  # finished long ago: nothing to abort
    assert_all_free(engine)
