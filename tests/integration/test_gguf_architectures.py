"""Qwen2, Qwen3 and Phi-3 GGUF files, laid out as llama.cpp's converter lays them out, served with
quantization="gguf": greedy fp32 output token for token what the dense checkpoint of the same
values generates (the safetensors path, HF-exact in test_architectures). An F32 file against the
checkpoint beside it in the same directory; a Q8_0 file, its blocks held as int8 weights,
against a checkpoint of gguf-py's dequantization of those blocks.
"""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import save_file

from pdserve import LLM, SamplingParams
from pdserve.engine.models.parallel import ParallelLinear
from pdserve.kernels.quant_weights import QuantizedWeight
from tests.gguf_files import Q, dequantized, write_gguf
from tests.integration.hf_reference import assert_same_greedy, mixed_prompts
from tests.tiny_models import write_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
VOCAB = 512
LONGROPE = {"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
            "long_factor": [2.0 + i for i in range(8)]}
CASES = {"qwen2": {},  # q/k/v biases, tied embeddings
         "qwen3": {"head_dim": 32},  # q/k norms, head_dim != hidden / heads
         "phi3": {"pad_token_id": 0, "original_max_position_embeddings": 512,
                  "rope_scaling": LONGROPE}}  # fused qkv and gate/up, longrope factors


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
    linears = [m for m in served.engine.core.runner.model.modules()
               if isinstance(m, ParallelLinear)]
    quantized = [isinstance(getattr(m.kernel, "weight", None), QuantizedWeight) and
                 m.kernel.weight.bits == 8 for m in linears]  # Q8_0: int8 blocks, not dense
    assert linears and all(q == (qtype == Q.Q8_0) for q in quantized)
    prompts = [list(mixed_prompts(VOCAB, seed=2)[i])[:100] for i in (0, 1, 3, 6)]  # 100, 1, 7, 33
    assert_same_greedy(served.generate(prompts, GREEDY), reference.generate(prompts, GREEDY))
