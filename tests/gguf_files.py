"""GGUF files made from a tiny Hugging Face checkpoint the way llama.cpp's converter makes them.

convert_hf_to_gguf.py, for the Qwen2, Qwen3, Phi-3, Qwen3-MoE and Mixtral models: every tensor
renamed through gguf-py's own `TensorNameMap` (Phi-3's fused qkv_proj / gate_up_proj stay fused,
as attn_qkv / ffn_up), 1-D tensors (norms, biases) and the MoE router (ffn_gate_inp) in F32,
other weights in the file's type (`--outtype q8_0`), Phi-3's longrope factors added as
rope_factors_long / rope_factors_short tensors, the head and expert counts in the metadata.
Qwen3-MoE's per-expert matrices are stacked, [experts, rows, columns], into ffn_gate_exps /
ffn_up_exps / ffn_down_exps (Qwen2MoeModel.modify_tensors); Mixtral is written as `llama`
(LlamaModel), its experts stacked likewise (w1 gate, w3 up, w2 down) and its q/k rows
interleaved for llama.cpp's RoPE (LlamaModel.permute); the others run with NeoX RoPE there and
keep their rows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

Q = gguf.GGMLQuantizationType
_ARCHS = {"Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2, "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
          "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3, "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
          "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA}
# one expert's matrix -> the name of its stack that TensorNameMap knows, as the converter merges
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_STACKED = {"mlp": "model.layers.{layer}.mlp.experts.{part}.weight",  # Qwen2MoeModel
            "block_sparse_moe": "layers.{layer}.feed_forward.experts.{part}.weight"}  # LlamaModel
# the MoE router, kept in F32 whatever the file's type (ModelBase.prepare_tensors)
ROUTER = re.compile(r"model\.layers\.\d+\.(mlp|block_sparse_moe)\.gate\.weight")


def write_gguf(model_dir: Path, qtype: Q = Q.F32, name: str = "model.gguf") -> Path:
    """`model_dir`'s safetensors as the GGUF file `model_dir / name`, weights as `qtype`."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = _ARCHS[config["architectures"][0]]
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    path = model_dir / name
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _add_metadata(writer, config)
    for hf_name, x in _converted(checkpoint(model_dir), config, arch).items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        if x.ndim >= 2 and qtype != Q.F32 and not ROUTER.fullmatch(hf_name):
            writer.add_tensor(gguf_name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, x)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}  # transformers 5, 4
    if "long_factor" in rope:  # Phi3MiniModel.generate_extra_tensors
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    """The counts the converter's set_gguf_parameters writes (those a reader here uses, and the
    experts' as TextModel / Qwen2MoeModel add them)."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def _converted(tensors: dict[str, torch.Tensor], config: dict, arch: gguf.MODEL_ARCH
               ) -> dict[str, np.ndarray]:
    """The checkpoint as the converter hands it to TensorNameMap: llama's q/k rows interleaved,
    each layer's experts stacked per part under the merged name."""
    out, stacks = {}, {}
    for name, tensor in tensors.items():
        x = tensor.numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            x = llama_cpp_permute(x, heads)
        match = _EXPERT.fullmatch(name)
        if match is None:
            out[name] = x
            continue
        merged = _STACKED[match[2]].format(layer=match[1], part=match[4])
        stacks.setdefault(merged, {})[int(match[3])] = x
    for merged, experts in stacks.items():
        out[merged] = np.stack([experts[e] for e in range(len(experts))])
    return out


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rows -> llama.cpp's RoPE order."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in fp32, by Hugging Face name."""
    (file,) = model_dir.glob("*.safetensors")
    return {name: t.float() for name, t in load_file(file).items()}


def dequantized(model_dir: Path, qtype: Q) -> dict[str, torch.Tensor]:
    """The checkpoint as a `write_gguf(model_dir, qtype)` file holds it: each 2-D weight but the
    MoE router is gguf-py's dequantization of its `qtype` blocks (an expert's rows are blocked
    alike alone or stacked)."""
    return {name: torch.from_numpy(np.array(gguf.quants.dequantize(
                gguf.quants.quantize(t.numpy(), qtype), qtype)))
            if t.dim() == 2 and not ROUTER.fullmatch(name) else t
            for name, t in checkpoint(model_dir).items()}
