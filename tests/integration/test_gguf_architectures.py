"""Qwen2, Qwen3, Phi-3, Qwen3-MoE and Mixtral GGUF files, laid out as llama.cpp's converter lays
them out, served with quantization="gguf": greedy fp32 output token for token what the dense
checkpoint of the same values generates, on the safetensors path (HF-exact in
test_architectures) and in transformers' `generate`. An F32 file against the checkpoint beside
it in the same directory; a Q8_0 file, its blocks held as int8 weights (the experts' too),
against a checkpoint of gguf-py's dequantization of those blocks.
"""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import save_file

from pdserve import LLM, SamplingParams
from pdserve.engine.models.parallel import FusedExperts, ParallelLinear
from pdserve.kernels.quant_weights import QuantizedWeight
from tests.gguf_files import Q, dequantized, write_gguf
from tests.integration.hf_reference import assert_same_greedy, hf_greedy, mixed_prompts
from tests.tiny_models import write_tiny_model

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
VOCAB = 512
EOS = 2  # tests.tiny_models' eos_token_id, where transformers' generate stops
LONGROPE = {"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
            "long_factor": [2.0 + i for i in range(8)]}
CASES = {"qwen2": {},  # q/k/v biases, tied embeddings
         "qwen3": {"head_dim": 32},  # q/k norms, head_dim != hidden / heads
         "phi3": {"pad_token_id": 0, "original_max_position_embeddings": 512,
                  "rope_scaling": LONGROPE},  # fused qkv and gate/up, longrope factors
         # top-2 of 4 experts, the top-2 weights not renormalized; written as qwen3moe
         "qwen3_moe": {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 32, "norm_topk_prob": False},
         # top-2 of 4 experts (renormalized); written as llama, its q/k rows interleaved
         "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> its tiny checkpoint (no tokenizer: prompts are token ids), written once."""
    return {arch: write_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=9, tokenizer=False,
                                   vocab_size=VOCAB, **overrides)
            for arch, overrides in CASES.items()}


def engine(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=32, num_threads=1,
               skip_tokenizer_init=True, **kw)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", sorted(CASES))
def test_gguf_generates_what_its_dense_weights_do(checkpoints, tmp_path, arch, qtype):
    gguf_dir = shutil.copytree(checkpoints[arch], tmp_path / "gguf")
    write_gguf(gguf_dir, qtype)  # beside config.json and the safetensors
    dense_dir = gguf_dir
    if qtype != Q.F32:
        dense_dir = shutil.copytree(checkpoints[arch], tmp_path / "dense")
        save_file(dequantized(dense_dir, qtype), dense_dir / "model.safetensors")
    served, reference = engine(gguf_dir, quantization="gguf"), engine(dense_dir)
    assert_weights_kept(served, quantized=qtype == Q.Q8_0)
    prompts = [list(mixed_prompts(VOCAB, seed=2)[i])[:100] for i in (0, 1, 3, 6)]  # 100, 1, 7, 33
    got = served.generate(prompts, GREEDY)
    assert_same_greedy(got, reference.generate(prompts, GREEDY))
    expected = hf_greedy(dense_dir, tuple(map(tuple, prompts)), MAX_TOKENS)
    assert tuple(until_eos(o.token_ids) for o in got) == expected


def assert_weights_kept(llm: LLM, quantized: bool) -> None:
    """Q8_0: every linear's weight and every layer's experts held as int8 blocks, not dense."""
    model = llm.engine.core.runner.model
    linears = [m for m in model.modules() if isinstance(m, ParallelLinear)]
    assert linears and all(
        (isinstance(getattr(m.kernel, "weight", None), QuantizedWeight) and
         m.kernel.weight.bits == 8) == quantized for m in linears)
    hidden = llm.config.model.hidden_size
    for experts in model.modules():
        if isinstance(experts, FusedExperts):
            dense = 3 * experts.local_experts * experts.inter * hidden * 4  # fp32
            held = sum(t.nbytes for t in experts.kernel.tensors)
            assert (held < dense / 2) == quantized, (held, dense)


def until_eos(tokens: list[int]) -> tuple[int, ...]:
    """Greedy tokens as transformers' `generate` returns them: up to the first EOS, kept."""
    return tuple(tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens)
