"""Speculative decoding, offline, on real (tiny and SmolLM2) models: the same tokens as
without it, greedy and seeded; stops cut inside an accepted run; every block back after
randomized runs with aborts and preemption."""

from __future__ import annotations

import random

import pytest

from pdserve import LLM, SamplingParams, StructuredOutputsParams
from tests.integration.test_engine_behaviour import assert_all_free
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory):
    """A random one-layer draft with the tiny models' vocabulary: it is mostly wrong."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-draft"), "llama", seed=9,
                            num_hidden_layers=1)


def spec_configs(target, draft) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
        # the target as its own draft: every draft is right, so long runs are accepted
        "draft-self": {"method": "draft", "model": str(target), "num_speculative_tokens": 4},
        "draft-random": {"method": "draft", "model": str(draft), "num_speculative_tokens": 2},
    }


def repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a random phrase, so n-gram lookups find matches."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, 40000) for _ in range(rng.randrange(3, 12))]
        tail = [rng.randrange(3, 40000) for _ in range(rng.randrange(0, 5))]
        prompts.append(phrase * rng.randrange(2, 5) + tail)
    return prompts


def make(model, spec=None, **kw) -> LLM:
    return LLM(model=str(model), num_threads=2, kv_cache_memory_bytes=32 << 20,
               speculative_config=spec, **kw)


@pytest.mark.parametrize("arch,method", [
    ("llama", "ngram"), ("llama", "draft-self"), ("llama", "draft-random"),
    ("qwen2", "ngram"), ("qwen2", "draft-self"),
])
def test_greedy_tokens_are_the_same_with_speculation(
    arch, method, tiny_llama_dir, tiny_qwen2_dir, tiny_draft_dir
):
    path = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    plain = make(path)
    spec = make(path, spec_configs(path, tiny_draft_dir)[method])
    prompts = repetitive_prompts(1, 6)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (1, 2, 7, 30, 41, 64)]
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = spec.engine.core.scheduler.stats
    assert stats.num_spec_verifications > 0 and stats.num_draft_tokens > 0
    if method == "draft-self":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert_all_free(spec.engine)


@pytest.mark.parametrize("method", ["ngram", "draft-self"])
def test_seeded_sampling_is_the_same_with_speculation(tiny_llama_dir, tiny_draft_dir, method):
    plain = make(tiny_llama_dir)
    spec = make(tiny_llama_dir, spec_configs(tiny_llama_dir, tiny_draft_dir)[method])
    prompts = repetitive_prompts(2, 7)
    params = [
        SamplingParams(temperature=0.8, max_tokens=40, seed=11, ignore_eos=True),
        # drafts checked against a grammar (a looping JSON array) and counted by penalties
        SamplingParams(temperature=0.05, max_tokens=24, seed=16, ignore_eos=True,
                       structured_outputs=StructuredOutputsParams(
                           json='{"type": "array", "items": {"enum": [1, 22, 333]}, '
                                '"minItems": 30}')),
        SamplingParams(temperature=0.8, max_tokens=24, seed=17, ignore_eos=True,
                       frequency_penalty=0.4, presence_penalty=0.2, repetition_penalty=1.1,
                       logit_bias={5: 3.0}, bad_words_token_ids=((7, 8),)),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=33, seed=12, ignore_eos=True),
        SamplingParams(temperature=0.6, top_p=0.9, max_tokens=25, seed=13, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, max_tokens=37, seed=14, ignore_eos=True),
        # nearly greedy: the output settles into loops, which the n-gram lookup copies
        SamplingParams(temperature=0.05, max_tokens=48, seed=15, ignore_eos=True),
    ]
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.engine.core.scheduler.stats.num_accepted_tokens > 0


def test_logprobs_are_those_of_the_plain_run(tiny_llama_dir, tiny_draft_dir):
    plain = make(tiny_llama_dir)
    spec = make(tiny_llama_dir, spec_configs(tiny_llama_dir, tiny_draft_dir)["draft-self"])
    prompts = repetitive_prompts(3, 2)
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3, ignore_eos=True)
    for a, b in zip(plain.generate(prompts, params), spec.generate(prompts, params)):
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
            assert [t for t, _ in y.top] == [t for t, _ in x.top]


def test_stops_cut_exactly_inside_an_accepted_run(tiny_llama_dir, tiny_draft_dir):
    """With the target as its own draft every step accepts up to 5 tokens; max_tokens, a
    stop token and a stop string falling inside such a run end the request at that token."""
    plain = make(tiny_llama_dir)
    spec = make(tiny_llama_dir, spec_configs(tiny_llama_dir, tiny_draft_dir)["draft-self"])
    prompt = repetitive_prompts(4, 1)[0]
    (full,) = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=40,
                                                      ignore_eos=True))
    stop_token = full.token_ids[13]
    stop_string = full.text[len(full.text) // 2:][:3]
    cases = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in range(1, 12)]
    cases += [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                       stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop_string]),
    ]
    want = plain.generate([prompt] * len(cases), cases)
    got = spec.generate([prompt] * len(cases), cases)
    for a, b in zip(want, got):
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
            a.token_ids, a.text, a.finish_reason, a.stop_reason)
    assert spec.engine.core.scheduler.stats.num_accepted_tokens > 0
    assert_all_free(spec.engine)


@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-random"])
def test_randomized_runs_with_aborts_return_every_block(tiny_llama_dir, tiny_draft_dir,
                                                        method):
    rng = random.Random(17)
    llm = make(tiny_llama_dir, spec_configs(tiny_llama_dir, tiny_draft_dir)[method],
               num_kv_blocks=28, max_model_len=384, max_num_batched_tokens=128)
    engine = llm.engine
    prompts = repetitive_prompts(5, 50)
    live = set()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randrange(1, 60),
            seed=rng.choice([None, i]), ignore_eos=rng.random() < 0.5,
        )
        engine.add_request(f"q{i}", prompt, params)
        live.add(f"q{i}")
        for _ in range(rng.randrange(0, 5)):
            live -= {o.request_id for o in engine.step() if o.finished}
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            assert engine.abort(victim).finish_reason == "abort"
            live.discard(victim)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.core.scheduler.stats
    assert stats.num_preemptions > 0 and stats.num_spec_verifications > 0
    assert_all_free(engine)


def test_smollm2_greedy_is_the_same_with_ngram_speculation(smollm2_dir):
    """fp32, the real checkpoint, prompts that invite copying."""
    plain = LLM(model=str(smollm2_dir), dtype="float32", num_threads=2)
    spec = LLM(model=str(smollm2_dir), dtype="float32", num_threads=2,
               speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    prompts = [
        "Repeat exactly: the red fox, the blue bird, the green frog, the red fox, the blue",
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(",
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    ]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = spec.engine.core.scheduler.stats
    assert stats.num_accepted_tokens > 0


def test_prefix_cache_holds_only_accepted_tokens(tiny_llama_dir, tiny_draft_dir):
    """After runs where most drafts are rejected, a prompt continuing an earlier request hits
    the blocks it cached, and generates what the plain engine does from scratch."""
    plain = make(tiny_llama_dir)
    spec = make(tiny_llama_dir, spec_configs(tiny_llama_dir, tiny_draft_dir)["draft-random"])
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = repetitive_prompts(6, 3)
    firsts = spec.generate(prompts, params)
    stats = spec.engine.core.scheduler.stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections happened
    follow_ups = [p + list(o.token_ids) for p, o in zip(prompts, firsts)]
    got = spec.generate(follow_ups, params)
    assert all(o.num_cached_tokens >= len(p) - 16 for o, p in zip(got, follow_ups))
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(follow_ups,
                                                                              params)]
