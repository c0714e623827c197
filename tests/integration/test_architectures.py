"""Every served architecture: greedy fp32 output token-identical to transformers' `generate`.

Tiny random checkpoints written by transformers itself, several configs per architecture
(GQA and MQA, tied and untied, explicit head_dim, sliding windows shorter than the prompts,
soft-capping, top-1 / top-2 / top-k routing, dense layers between sparse ones). Offline,
requests arrive staggered so prefills, prefill chunks and decodes share steps, with prefix
caching on. Then the same tokens through a prefill worker and a decode worker (every prompt
prefilled remotely, its KV pushed), and from a decode group of two processes: tensor-parallel,
and expert-parallel (each rank holds half the experts whole).
"""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.engine_core import EngineCore
from tests.integration.hf_reference import hf_greedy, mixed_prompts
from tests.integration.test_tensor_parallel import make_config, run_group, run_requests
from tests.tiny_models import write_tiny_model
from tests.workers.pd import generate_pd, loopback_pair

MAX_TOKENS = 12
GEMMA3_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
               "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}
CASES = {
    "qwen3-gqa-head_dim": ("qwen3", dict(head_dim=32)),
    "qwen3-mqa-tied-window": ("qwen3", dict(
        num_key_value_heads=1, tie_word_embeddings=True, use_sliding_window=True,
        sliding_window=40, max_window_layers=1)),
    "mistral-window": ("mistral", dict(sliding_window=40)),
    "phi3": ("phi3", dict(pad_token_id=0)),
    "phi3-longrope-window": ("phi3", dict(
        pad_token_id=0, sliding_window=48, original_max_position_embeddings=512,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                      "long_factor": [2.0 + i for i in range(8)]})),
    "gemma2-softcap": ("gemma2", dict(
        head_dim=16, sliding_window=40, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
        final_logit_softcapping=15.0)),
    "gemma3-local-global": ("gemma3_text", dict(
        num_hidden_layers=3, head_dim=32, sliding_window=40,
        layer_types=GEMMA3_TYPES, rope_parameters=GEMMA3_ROPE, query_pre_attn_scalar=32)),
    "mixtral-top2": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-top1-of-2": ("mixtral", dict(num_local_experts=2, num_experts_per_tok=1)),
    "qwen3moe-top1": ("qwen3_moe", dict(
        num_experts=8, num_experts_per_tok=1, moe_intermediate_size=48, norm_topk_prob=False)),
    "qwen3moe-top4-sparse-step": ("qwen3_moe", dict(
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[2])),
}


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
    got = tuple(tuple(outputs[f"r{i}"].token_ids) for i in range(len(prompts)))
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not mismatches, f"prompts {mismatches}: got {[got[i] for i in mismatches]}, " \
        f"transformers {[expected[i] for i in mismatches]}"
    assert engine.core.kv_cache.num_free_blocks == engine.config.cache.num_blocks


@pytest.mark.parametrize("case", ["gemma3-local-global", "qwen3moe-top4-sparse-step"])
def test_prefill_and_decode_workers_match(checkpoint, prompts, case):
    """Every prompt prefilled by the prefill worker, its KV pushed, decoded by the other."""
    model_dir = checkpoint(case)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with loopback_pair(model_dir) as (prefill, decode):
        got = tuple(tuple(generate_pd(prefill, decode, f"r{i}", list(p), params))
                    for i, p in enumerate(prompts))
        for worker in (prefill, decode):
            assert worker.stats().num_free_blocks == worker.stats().num_blocks
    assert got == expected


@pytest.mark.parametrize(("case", "expert_parallel", "which"), [
    ("qwen3moe-top4-sparse-step", False, slice(0, 4)),
    ("qwen3moe-top4-sparse-step", True, slice(0, 4)),
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
