"""Every served architecture: greedy fp32 output token-identical to transformers' `generate`.

Tiny random checkpoints written by transformers itself, several configs per architecture
(GQA and MQA, tied and untied, explicit head_dim, sliding windows shorter than the prompts,
soft-capping, top-1 / top-2 / top-k routing, dense layers between sparse ones; DeepSeek-V3's
latent attention with and without q LoRA and group-limited routing; gpt-oss's sinks, biased
experts and MXFP4 experts). Offline, requests arrive staggered so prefills, prefill chunks and
decodes share steps, with prefix caching on. Then the same tokens through a prefill worker and
a decode worker (every prompt prefilled remotely, its KV pushed: exactly the bytes the config
implies per token), from a decode group of two processes (tensor-parallel, and expert-parallel:
each rank holds half the experts whole), and a latent cache pushed into a decode group of two.
"""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoConfig

from pdserve import LLM, SamplingParams
from pdserve.engine.engine_core import EngineCore
from tests.integration.hf_reference import hf_greedy, mixed_prompts
from tests.integration.test_tensor_parallel import make_config, run_group, run_requests
from tests.tiny_models import CASES, write_mxfp4_twin, write_tiny_model
from tests.workers.pd import engine_config, generate_pd, loopback_pair, run_engine
from tests.workers.processes import spawn_prefill, start_decode_group, wait_ready
from tests.workers.test_processes_pd import assert_all_free, run_batch

MAX_TOKENS = 12
@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(49152, seed=3)[:4]  # 300 tokens (past every window), 1, shared 150


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """case -> its checkpoint directory, written once per module."""
    written = {}

    def get(case):
        if case not in written:
            model_type, overrides = CASES[case]
            written[case] = write_tiny_model(tmp_path_factory.mktemp(case), model_type, seed=7,
                                             **overrides)
        return written[case]

    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(checkpoint, prompts, case):
    model_dir = checkpoint(case)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert offline_greedy(model_dir, prompts) == expected


def test_gpt_oss_mxfp4_experts_match_transformers(checkpoint, prompts, tmp_path):
    """A gpt-oss checkpoint with its experts in MXFP4, as released: the same tokens as
    transformers on a dense twin holding exactly the values the codes stand for."""
    dense = tmp_path / "dense"
    shutil.copytree(checkpoint("gpt-oss-sinks-window"), dense)
    packed = write_mxfp4_twin(dense, tmp_path / "mxfp4")
    assert offline_greedy(packed, prompts) == hf_greedy(dense, prompts, MAX_TOKENS)


def offline_greedy(model_dir, prompts) -> tuple[tuple[int, ...], ...]:
    """Greedy tokens of `prompts` from the offline engine, requests arriving staggered; checks
    every block is free after."""
    llm = LLM(model=str(model_dir), dtype="float32", num_threads=2, max_num_batched_tokens=256,
              max_model_len=512, block_size=16)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs, queue = {}, [(f"r{i}", list(p)) for i, p in enumerate(prompts)]
    for request in queue[:2]:
        engine.add_request(*request, params)
    queue = queue[2:]
    while queue or engine.has_unfinished_requests():
        if queue:
            engine.add_request(*queue.pop(0), params)
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.core.kv_cache.num_free_blocks == engine.config.cache.num_blocks
    return tuple(tuple(outputs[f"r{i}"].token_ids) for i in range(len(prompts)))


@pytest.mark.parametrize("case", ["gemma3-local-global", "qwen3moe-top4-sparse-step",
                                  "deepseek-v3-qlora-grouped", "gpt-oss-sinks-window"])
def test_prefill_and_decode_workers_match(checkpoint, prompts, case):
    """Every prompt prefilled by the prefill worker, its KV pushed, decoded by the other."""
    model_dir = checkpoint(case)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with loopback_pair(model_dir) as (prefill, decode):
        sender = prefill.connector.sender
        got = [tuple(generate_pd(prefill, decode, "r0", list(prompts[0]), params))]
        # the first prompt: nothing held on the decode side, every block of it pushed
        blocks = -(-len(prompts[0]) // prefill.layout.block_size)
        assert sender.sent_nbytes == blocks * prefill.layout.block_size * \
            kv_bytes_per_token(AutoConfig.from_pretrained(model_dir))
        got += [tuple(generate_pd(prefill, decode, f"r{i}", list(p), params))
                for i, p in enumerate(prompts) if i]
        for worker in (prefill, decode):
            assert worker.stats().num_free_blocks == worker.stats().num_blocks
    assert tuple(got) == expected


def kv_bytes_per_token(hf) -> int:
    """fp32 KV of one token, from the checkpoint's config: per layer MLA's latent and shared
    RoPE key, or K and V of every KV head."""
    if getattr(hf, "kv_lora_rank", None):
        per_layer = hf.kv_lora_rank + hf.qk_rope_head_dim
    else:
        per_layer = 2 * hf.num_key_value_heads * (getattr(hf, "head_dim", None)
                                                  or hf.hidden_size // hf.num_attention_heads)
    return 4 * hf.num_hidden_layers * per_layer


@pytest.mark.parametrize(("case", "expert_parallel", "which"), [
    # experts sliced, their down bias added once; then whole, with their biases
    ("gpt-oss-sinks-window", False, slice(0, 4)),
    ("gpt-oss-sinks-window", True, slice(0, 4)),
    # one request, one expert per token: every decode step's token is on one rank's expert
    ("mixtral-top1-of-2", True, slice(1, 2)),
])
def test_decode_group_of_two_matches_one_process(checkpoint, prompts, case, expert_parallel,
                                                 which):
    """TP-2 slices the heads and every expert; EP-2 gives each rank half the experts whole."""
    model_dir = checkpoint(case)
    prompts = [list(p) for p in prompts[which]]
    expected = run_requests(EngineCore(make_config(model_dir)), prompts)
    assert run_group(model_dir, prompts, expert_parallel=expert_parallel) == expected


def test_latent_kv_into_an_expert_parallel_decode_group_of_two(checkpoint, prompts):
    """Prefill TP-1, decode TP-2 with EP-2, in processes over gloo: each decode rank receives
    the whole latent (its attention heads split, the latent not) and holds half the routed
    experts whole."""
    model_dir = checkpoint("deepseek-v3-qlora-grouped")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prefill = spawn_prefill(model_dir)  # starts while the group does and `expected` runs
    hosts = []
    try:
        hosts = start_decode_group(model_dir, tp_size=2, expert_parallel=True)
        expected = run_engine(EngineCore(engine_config(model_dir)), prompts, params)
        ids = [f"r{i}" for i in range(len(prompts))]
        firsts = run_batch(wait_ready(prefill), hosts[0], ids, [list(p) for p in prompts],
                           params)
        assert all("first_token" in r for r in firsts.values()), firsts
        assert [hosts[0].call("collect", id=rid)["tokens"] for rid in ids] == expected
        assert_all_free(hosts[0])
        assert_all_free(prefill)
    finally:
        prefill.stop()
        for host in hosts:
            host.stop()
