"""Load a checkpoint into our network, each tensor straight into its final slot.

The formats differ only in how they are read: HF safetensors (dense), GPTQ/AWQ safetensors
(`engine.quant_checkpoints`) and GGUF (`engine.gguf_weights`) each yield (HF tensor name,
dense tensor or `QuantizedWeight`) pairs, and `load_tensors` routes every pair to its module.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.quantization import Quantization
from pdserve.kernels.quant_weights import QuantizedWeight, quantize

logger = logging.getLogger(__name__)

Weight = torch.Tensor | QuantizedWeight

# HF tensor name -> (our module path, fused shard name)
_RULES = [
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)"),
     lambda m: (f"layers.{m[1]}.self_attn.qkv_proj", m[2], m[3])),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight)"),
     lambda m: (f"layers.{m[1]}.self_attn.o_proj", "", m[2])),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.(weight)"),
     lambda m: (f"layers.{m[1]}.mlp.gate_up_proj", m[2], m[3])),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.down_proj\.(weight)"),
     lambda m: (f"layers.{m[1]}.mlp.down_proj", "", m[2])),
    (re.compile(r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.(weight)"),
     lambda m: (f"layers.{m[1]}.{m[2]}", "", m[3])),
    (re.compile(r"model\.(embed_tokens|norm)\.(weight)"), lambda m: (m[1], "", m[2])),
    (re.compile(r"(lm_head)\.(weight)"), lambda m: (m[1], "", m[2])),
]
_LINEAR_WEIGHT = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def load_weights(model: torch.nn.Module, path: str | Path,
                 quantization: Quantization | None = None) -> None:
    """Fill every parameter of `model` from the checkpoint in `path`, in its format."""
    path = Path(path)
    method = quantization.method if quantization is not None else None
    if method == "gguf":
        from pdserve.engine.gguf_weights import gguf_file, iter_gguf

        file = gguf_file(path)
        load_tensors(model, iter_gguf(file), str(file))
    elif method in ("gptq", "awq"):
        from pdserve.engine.quant_checkpoints import checkpoint_quantization, iter_quantized

        load_tensors(model, iter_quantized(path, checkpoint_quantization(path)), str(path))
    else:
        named = iter_safetensors(path)
        if quantization is not None and quantization.bits:
            named = _quantize_linears(named, quantization)
        load_tensors(model, named, str(path))


def _quantize_linears(named: Iterable[tuple[str, Weight]], quantization: Quantization
                      ) -> Iterator[tuple[str, Weight]]:
    """Round-to-nearest quantization of every linear layer's weight, whole (before any
    tensor-parallel shard is cut), so every TP size serves the same values."""
    for name, tensor in named:
        if _LINEAR_WEIGHT.fullmatch(name):
            tensor = quantize(tensor, quantization.bits, quantization.group_size)
        yield name, tensor


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                yield name, f.get_tensor(name)


def load_tensors(model: torch.nn.Module, named: Iterable[tuple[str, Weight]],
                 source: str) -> None:
    """Route each (HF name, tensor) to its module's `load`; ValueError if any is missing."""
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()
    tied = model.lm_head is model.embed_tokens
    for name, tensor in named:
        if _IGNORED.match(name) or (tied and name == "lm_head.weight"):
            continue
        module_path, shard, param = _target(name)
        model.get_submodule(module_path).load(param, tensor, shard)
        loaded.add(f"{module_path}.{param}")
    missing = expected - loaded
    if missing:
        raise ValueError(f"model: checkpoint {source} lacks {sorted(missing)[:5]}")
    logger.info("loaded %d tensors from %s", len(loaded), source)


def _target(name: str) -> tuple[str, str, str]:
    for pattern, target in _RULES:
        match = pattern.fullmatch(name)
        if match:
            return target(match)
    raise ValueError(f"model: unexpected tensor {name!r} in checkpoint")
