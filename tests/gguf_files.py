"""GGUF files made from a tiny Hugging Face checkpoint the way llama.cpp's converter makes them.

convert_hf_to_gguf.py, for the dense Qwen2, Qwen3 and Phi-3 models: every tensor renamed through
gguf-py's own `TensorNameMap` (Phi-3's fused qkv_proj / gate_up_proj stay fused, as attn_qkv /
ffn_up), no q/k row permutation (llama.cpp runs these with NeoX RoPE), 1-D tensors (norms,
biases) in F32, 2-D ones in the file's type (`--outtype q8_0`), Phi-3's longrope factors added
as rope_factors_long / rope_factors_short tensors, the head counts in the metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

Q = gguf.GGMLQuantizationType
_ARCHS = {"Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2, "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
          "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3}


def write_gguf(model_dir: Path, qtype: Q = Q.F32, name: str = "model.gguf") -> Path:
    """`model_dir`'s safetensors as the GGUF file `model_dir / name`, 2-D weights as `qtype`."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = _ARCHS[config["architectures"][0]]
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    path = model_dir / name
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    for hf_name, tensor in checkpoint(model_dir).items():
        x = tensor.numpy()
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        if x.ndim == 2 and qtype != Q.F32:
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


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in fp32, by Hugging Face name."""
    (file,) = model_dir.glob("*.safetensors")
    return {name: t.float() for name, t in load_file(file).items()}


def dequantized(model_dir: Path, qtype: Q) -> dict[str, torch.Tensor]:
    """The checkpoint as a `write_gguf(model_dir, qtype)` file holds it: each 2-D weight is
    gguf-py's dequantization of its `qtype` blocks."""
    return {name: torch.from_numpy(np.array(gguf.quants.dequantize(
                gguf.quants.quantize(t.numpy(), qtype), qtype))) if t.dim() == 2 else t
            for name, t in checkpoint(model_dir).items()}
