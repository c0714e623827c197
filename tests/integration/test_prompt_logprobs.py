"""SamplingParams(prompt_logprobs=k) against transformers (fp32): every prompt position's
logprob is HF's log_softmax(logits)[p - 1, token], with its rank and the same top-k, whole
prompts or chunked ones, with the prefix cache holding the prompt, under preemption and
with speculative decoding; without it nothing changes.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.integration.hf_reference import mixed_prompts

TOL = 1e-4
K = 5


@cache
def hf_logprobs(model_dir: Path, prompt: tuple[int, ...]) -> torch.Tensor:
    """[len(prompt), V]: row i is log_softmax of the logits at position i (fp32)."""
    model = _hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt))).logits
    return logits[0].float().log_softmax(dim=-1)


@cache
def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def check_against_hf(model_dir: Path, prompt: tuple[int, ...], got: list, k: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    ref = hf_logprobs(model_dir, prompt)
    for p in range(1, len(prompt)):
        row, token, entry = ref[p - 1], prompt[p], got[p]
        want = row[token].item()
        assert entry[token].logprob == pytest.approx(want, abs=TOL), p
        # rank: tokens at least as likely; fp32 ties deep in the tail may tip either way
        assert (row > want + TOL).sum() + 1 <= entry[token].rank <= (row >= want - TOL).sum()
        top = row.topk(k)
        by_rank = sorted((lp.rank, t) for t, lp in entry.items() if t != token or
                         t in top.indices.tolist())
        assert [t for _, t in by_rank] == top.indices.tolist(), p
        assert [r for r, _ in by_rank] == list(range(1, k + 1))
        for t, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t].logprob == pytest.approx(value, abs=TOL)
        assert set(entry) == {token, *top.indices.tolist()}


def make(model_dir, **kwargs) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", num_threads=2, **kwargs)


def prompts_of(vocab_size: int) -> list[tuple[int, ...]]:
    return list(mixed_prompts(vocab_size, seed=5)[:8])  # 1 to 300 tokens, shared prefixes


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("budget", [2048, 40])  # whole prompts; chunks of <= 40 tokens
def test_prompt_logprobs_match_transformers(arch, budget, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    llm = make(model_dir, max_num_batched_tokens=budget)
    prompts = prompts_of(llm.config.model.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        check_against_hf(model_dir, prompt, out.prompt_logprobs, K)
        assert out.num_cached_tokens == 0
    texts = {lp.decoded_token for lp in out.prompt_logprobs[1].values()}
    assert texts == {llm.tokenizer.decode([t]) for t in out.prompt_logprobs[1]}


def test_a_cached_prompt_is_computed_whole(tiny_llama_dir):
    llm = make(tiny_llama_dir, max_num_batched_tokens=64)
    prompt = prompts_of(llm.config.model.vocab_size)[0]  # 300 tokens
    plain = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate([prompt], plain)[0]
    assert first.prompt_logprobs is None
    asked = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4,
                                                  prompt_logprobs=0))[0]
    assert asked.num_cached_tokens == 0 and asked.token_ids == first.token_ids
    assert all(len(entry) == 1 for entry in asked.prompt_logprobs[1:])
    check_against_hf_values(tiny_llama_dir, prompt, asked.prompt_logprobs)
    again = llm.generate([prompt], plain)[0]  # its blocks were published all the same
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None


def check_against_hf_values(model_dir, prompt, got) -> None:
    assert len(got) == len(prompt) and got[0] is None
    ref = hf_logprobs(model_dir, prompt)
    values = torch.tensor([got[p][prompt[p]].logprob for p in range(1, len(prompt))])
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
    assert torch.allclose(values, want, rtol=0, atol=TOL)


def test_preempted_requests_keep_one_entry_per_position(tiny_llama_dir):
    # 352 tokens of KV for ~1300 tokens of demand, chunks of 48: prompts are recomputed
    llm = make(tiny_llama_dir, block_size=16, num_kv_blocks=22, max_model_len=352,
               max_num_batched_tokens=48)
    prompts = prompts_of(llm.config.model.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                             prompt_logprobs=0 if i % 2 else None) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert llm.engine.core.scheduler.stats.num_preemptions > 0
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if i % 2:
            check_against_hf_values(tiny_llama_dir, prompt, out.prompt_logprobs)
        else:
            assert out.prompt_logprobs is None
    assert llm.engine.core.kv_cache.num_free_blocks == llm.config.cache.num_blocks


def test_speculative_decoding_leaves_them_and_the_tokens_alone(tiny_llama_dir):
    prompt = tuple([11, 12, 13, 14, 15] * 8)  # repeats: n-gram drafts are proposed
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    spec = make(tiny_llama_dir, speculative_config={"method": "ngram",
                                                    "num_speculative_tokens": 3})
    plain = make(tiny_llama_dir)
    got, want = spec.generate([prompt], params)[0], plain.generate([prompt], params)[0]
    assert got.token_ids == want.token_ids
    assert spec.engine.core.scheduler.stats.num_spec_verifications > 0
    check_against_hf(tiny_llama_dir, prompt, got.prompt_logprobs, 2)


def test_without_prompt_logprobs_outputs_are_unchanged(tiny_llama_dir):
    llm = make(tiny_llama_dir, skip_tokenizer_init=True)
    prompts = prompts_of(llm.config.model.vocab_size)[:4]
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    asked = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1))
    for p, a in zip(plain, asked):
        assert p.prompt_logprobs is None and a.token_ids == p.token_ids
        assert all(lp.decoded_token is None for e in a.prompt_logprobs[1:] for lp in e.values())


def run_core_prompt_logprobs(core, prompts) -> list[list[tuple]]:
    """Every prompt through an EngineCore with prompt_logprobs=3, chunks of <= 64 tokens."""
    from pdserve.engine.request import Request

    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"r{i}", tuple(prompt), params))
    got = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.prompt_logprobs is not None:
                got[out.request_id] = [(lp.token_id, lp.logprob, lp.rank, lp.top)
                                       for lp in out.prompt_logprobs]
    return [got[f"r{i}"] for i in range(len(prompts))]


def tp_config(model_dir):
    from dataclasses import replace

    from pdserve.engine.config import SchedulerConfig
    from tests.integration.test_tensor_parallel import make_config

    return replace(make_config(model_dir), scheduler=SchedulerConfig(8, 64))


def tp_rank_main(rank, size, port, model_dir, prompts, results):
    import datetime
    import traceback

    import torch.distributed as dist

    from pdserve.engine.engine_core import EngineCore
    from pdserve.engine.models.parallel import TensorParallel
    from pdserve.engine.plan_broadcast import follow

    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, None, rank == 0, wait_for_workers=False)
        group = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, size,
                                      datetime.timedelta(seconds=60))
        core = EngineCore(tp_config(model_dir), TensorParallel(rank, size, group))
        if rank == 0:
            results.put(("ok", run_core_prompt_logprobs(core, prompts)))
            core.shutdown()
        else:
            follow(core.runner, core.tp)
    except BaseException:
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def test_tensor_parallel_ranks_compute_them_together(tiny_llama_dir):
    import multiprocessing as mp

    from pdserve.engine.engine_core import EngineCore
    from tests.integration.test_tensor_parallel import free_port

    prompts = [list(p) for p in prompts_of(49152)[:4]]
    expected = run_core_prompt_logprobs(EngineCore(tp_config(tiny_llama_dir)), prompts)
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=tp_rank_main, args=(r, 2, port, tiny_llama_dir, prompts, results))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        status, got = results.get(timeout=180)
        assert status == "ok", got
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    for want_prompt, got_prompt in zip(expected, got, strict=True):
        assert [(t, tuple(i for i, _ in top)) for t, _, _, top in got_prompt] == [
            (t, tuple(i for i, _ in top)) for t, _, _, top in want_prompt]
        assert max((abs(g[1] - w[1]) for g, w in zip(got_prompt, want_prompt)), default=0) < TOL
