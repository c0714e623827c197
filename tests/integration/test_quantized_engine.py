"""Quantized weights served end to end on the tiny models: the engine computes what its
quantized weights say (MoE experts too), every TP size serves the same values, and the bytes
shrink."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.loader import _LINEAR_WEIGHT
from pdserve.engine.models.parallel import FusedExperts, ParallelLinear
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels.cpu.quant_linear import Int4Linear
from pdserve.kernels.quant_weights import dequantize, quantize
from pdserve.llm import LLM
from tests.integration.hf_reference import assert_same_greedy, mixed_prompts
from tests.tiny_models import write_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
METHODS = [("int8", 0), ("int4", 32), ("int4", 64)]


def dequantized_checkpoint(src, dst, bits, group_size):
    """A dense copy of `src` whose linear weights are their quantized values."""
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({name: dequantize(quantize(t, bits, group_size)).to(t.dtype)
                   if _LINEAR_WEIGHT.fullmatch(name) else t
                   for name, t in tensors.items()}, file)
    return dst


def engine(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=64,
               num_threads=1, **kw)


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-moe"), "qwen3_moe", seed=4,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_moe_dir"])
@pytest.mark.parametrize("method,group_size", METHODS)
def test_quantized_engine_serves_its_dequantized_weights(request, tmp_path, model, method,
                                                         group_size):
    src = request.getfixturevalue(model)
    bits = 8 if method == "int8" else 4
    quantized = engine(src, quantization=method, quantization_group_size=group_size)
    reference = engine(dequantized_checkpoint(src, tmp_path / "dense", bits, group_size))
    prompts = [list(p)[:120] for p in mixed_prompts(quantized.config.model.vocab_size, 5)[:4]]
    assert_same_greedy(quantized.generate(prompts, GREEDY), reference.generate(prompts, GREEDY))
    assert quantized.weight_bytes < reference.weight_bytes
    for experts in quantized.engine.core.runner.model.modules():  # held quantized, not dense
        if isinstance(experts, FusedExperts):
            hidden = quantized.config.model.hidden_size
            dense = 3 * experts.local_experts * experts.inter * hidden * 4  # fp32
            assert sum(t.nbytes for t in experts.kernel.tensors) < dense / 2


def test_bf16_int4_saves_the_linears_bytes(tiny_llama_dir):
    dense = LLM(str(tiny_llama_dir), dtype="bfloat16", max_model_len=256, num_kv_blocks=16,
               num_threads=1)
    int4 = LLM(str(tiny_llama_dir), dtype="bfloat16", quantization="int4", max_model_len=256,
               num_kv_blocks=16,
               num_threads=1)
    model = dense.config.model
    attention = model.hidden_size * (2 * model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    per_layer = attention + 3 * model.hidden_size * model.intermediate_size  # + gate, up, down
    linear_bytes = 2 * model.num_layers * per_layer
    # int4 linears: half a byte a weight, and a bf16 scale and zero (4 bytes) per 32 weights
    saved = dense.weight_bytes - int4.weight_bytes
    assert saved == linear_bytes - linear_bytes // 4 - linear_bytes // 16


def test_gguf_serves_the_bundled_q4_1_blocks_as_int4(smollm2_dir):
    """The default model's GGUF, its Q4_1 blocks held as int4: in fp32 it generates what the
    dense checkpoint converted from the same GGUF does (same values, other kernels)."""
    gguf = engine(smollm2_dir, quantization="gguf")
    dense = engine(smollm2_dir)
    linears = [m for m in gguf.engine.core.runner.model.modules()
               if isinstance(m, ParallelLinear)]
    assert linears and all(isinstance(m.kernel, Int4Linear) and m.weight is None
                           for m in linears)
    prompts = [gguf.tokenizer("The capital of France is").input_ids,
               gguf.tokenizer("def fibonacci(n):").input_ids]
    got, want = gguf.generate(prompts, GREEDY), dense.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert gguf.weight_bytes < dense.weight_bytes / 2.5


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_checkpoints_serve_their_dequantized_weights(tiny_llama_dir, tmp_path,
                                                                  method):
    """The tiny Llama with every linear replaced by random 4-bit values in the format's
    packing; the engine serves what a dense checkpoint of the format's dequantization does."""
    from tests.quant_checkpoint_files import awq_tensors, gptq_tensors, random_linear

    quantized_dir, dense_dir = tmp_path / method, tmp_path / "dense"
    shutil.copytree(tiny_llama_dir, quantized_dir)
    shutil.copytree(tiny_llama_dir, dense_dir)
    gen = torch.Generator().manual_seed(7)
    (file,) = quantized_dir.glob("*.safetensors")
    packed, dense = {}, {}
    for name, tensor in load_file(file).items():
        if not _LINEAR_WEIGHT.fullmatch(name):
            packed[name] = dense[name] = tensor.float()
            continue
        out_f, in_f = tensor.shape
        lin = random_linear(in_f, out_f, 32, (1, 15), gen)
        prefix = name.removesuffix(".weight")
        packed |= gptq_tensors(prefix, lin) if method == "gptq" else awq_tensors(prefix, lin)
        dense[name] = lin.reference().contiguous()
    save_file(packed, file)
    save_file(dense, next(dense_dir.glob("*.safetensors")))
    config = json.loads((quantized_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 32,
                                     **({"desc_act": False, "sym": False} if method == "gptq"
                                        else {"version": "gemm", "zero_point": True})}
    (quantized_dir / "config.json").write_text(json.dumps(config))
    quantized, reference = engine(quantized_dir), engine(dense_dir)
    assert quantized.config.model.quantization.method == method  # found from config.json
    prompts = [list(p)[:100] for p in mixed_prompts(quantized.config.model.vocab_size, 9)[:3]]
    got, want = quantized.generate(prompts, GREEDY), reference.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
