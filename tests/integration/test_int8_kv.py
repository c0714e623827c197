"""int8 KV cache end to end: greedy agreement and log-prob error vs a full-precision cache,
and the KV memory it saves."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.config import CacheConfig, load_model_config, with_num_blocks
from tests.integration.hf_reference import mixed_prompts

MAX_TOKENS = 24


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def runs(tiny_llama_dir):
    prompts = [list(p) for p in mixed_prompts(49152, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=20)
    results = {}
    for cache_dtype in ("auto", "int8"):
        llm = LLM(
            model=str(tiny_llama_dir), num_threads=2, kv_cache_memory_bytes=64 << 20,
            kv_cache_dtype=cache_dtype,
        )
        results[cache_dtype] = llm.generate(prompts, params)
    return results


def logprob_error(a, b, position: int) -> float:
    """Largest |log-prob difference| over tokens in both runs' top-20 at `position`."""
    ref = dict(a.logprobs[position].top)
    return max(abs(ref[t] - lp) for t, lp in b.logprobs[position].top if t in ref)


def test_int8_only_flips_near_ties(runs):
    """Where int8 greedy output first differs, the full-precision top-2 gap was within the
    log-prob error int8 made at that very position (same context up to there): a flip needs
    gap <= 2 * error. Elsewhere the outputs are the same."""
    full, int8 = runs["auto"], runs["int8"]
    agreed, errors = 0, []
    for a, b in zip(full, int8):
        i = first_divergence(a.token_ids, b.token_ids)
        agreed += i
        errors += [logprob_error(a, b, j) for j in range(min(i + 1, MAX_TOKENS))]
        if i < MAX_TOKENS:
            (_, top1), (_, top2) = a.logprobs[i].top[:2]
            assert top1 - top2 <= 2 * logprob_error(a, b, i) + 1e-6
    agreement = agreed / (MAX_TOKENS * len(full))
    print(f"int8 KV: {agreement:.3f} of greedy tokens agree before the first divergence; "
          f"max top-20 log-prob error {max(errors):.2e}")
    assert max(errors) < 0.05  # attention error <= 2e-2 relative (tests/kernels) keeps it small


def test_int8_cache_holds_about_twice_the_tokens(tiny_llama_dir):
    model = load_model_config(tiny_llama_dir, dtype="float16")
    budget = 64 << 20
    fp16 = with_num_blocks(CacheConfig(kv_cache_memory_bytes=budget), model).num_blocks
    int8 = with_num_blocks(
        CacheConfig(kv_cache_memory_bytes=budget, cache_dtype="int8"), model
    ).num_blocks
    ratio = model.kv_bytes_per_token("int8") / model.kv_bytes_per_token()
    # head_dim 16 here: int8 values are half of fp16; the fp16 scale per token and head adds
    # 2 / (2 * head_dim) of the fp16 size
    head_dim = model.head_dim
    assert ratio == pytest.approx(0.5 + 1 / head_dim)
    assert int8 / fp16 == pytest.approx(1 / ratio, rel=0.01)
