"""Load a checkpoint into our network, each tensor straight into its final slot.

The formats differ only in how they are read: HF safetensors (dense), GPTQ/AWQ safetensors
(`engine.quant_checkpoints`) and GGUF (`engine.gguf_weights`) each yield (HF tensor name,
dense tensor or `QuantizedWeight`) pairs, and `load_tensors` routes every pair to its module.
Phi-3's fused q/k/v and gate/up matrices are cut into their parts on the way, whatever the
format (`split_fused`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.config import ModelConfig
from pdserve.engine.quantization import Quantization
from pdserve.kernels.quant_weights import QuantizedWeight, quantize

logger = logging.getLogger(__name__)

Weight = torch.Tensor | QuantizedWeight

_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down", "w2": "down"}
# HF tensor name -> (our module path, fused shard name)
_RULES = [
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)"),
     lambda m: (f"layers.{m[1]}.self_attn.qkv_proj", m[2], m[3])),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)"),
     lambda m: (f"layers.{m[1]}.self_attn.o_proj", "", m[2])),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.(weight)"),
     lambda m: (f"layers.{m[1]}.mlp.gate_up_proj", m[2], m[3])),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.down_proj\.(weight)"),
     lambda m: (f"layers.{m[1]}.mlp.down_proj", "", m[2])),
    (re.compile(r"model\.layers\.(\d+)\.((?:input|post_attention|pre_feedforward|"
                r"post_feedforward)_layernorm)\.(weight)"),
     lambda m: (f"layers.{m[1]}.{m[2]}", "", m[3])),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.([qk]_norm)\.(weight)"),
     lambda m: (f"layers.{m[1]}.self_attn.{m[2]}", "", m[3])),
    # Mixture of experts: Qwen3-MoE's mlp.*, Mixtral's block_sparse_moe.* (w1 gate, w3 up,
    # w2 down), or all experts stacked as transformers 5 holds them
    (re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.(weight)"),
     lambda m: (f"layers.{m[1]}.mlp.gate", "", m[2])),
    (re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"),
     lambda m: (f"layers.{m[1]}.mlp.experts", f"{m[2]}.{_EXPERT_PART[m[3]]}",
                "w2" if _EXPERT_PART[m[3]] == "down" else "w13")),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj"),
     lambda m: (f"layers.{m[1]}.mlp.experts", m[2], "w2" if m[2] == "down" else "w13")),
    (re.compile(r"model\.(embed_tokens|norm)\.(weight)"), lambda m: (m[1], "", m[2])),
    (re.compile(r"(lm_head)\.(weight)"), lambda m: (m[1], "", m[2])),
]
_LINEAR_WEIGHT = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|"
    r"(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3))\.weight")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# Phi-3 keeps q/k/v and gate/up fused in one tensor each: split into the names of the others
_FUSED = re.compile(r"(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight")


def load_weights(model: torch.nn.Module, path: str | Path,
                 quantization: Quantization | None = None) -> None:
    """Fill every parameter of `model` from the checkpoint in `path`, in its format."""
    path = Path(path)
    method = quantization.method if quantization is not None else None
    if method == "gguf":
        from pdserve.engine.gguf_weights import gguf_file, iter_gguf

        file = gguf_file(path)
        load_tensors(model, split_fused(iter_gguf(file), model.config), str(file))
    elif method in ("gptq", "awq"):
        from pdserve.engine.quant_checkpoints import checkpoint_quantization, iter_quantized

        named = iter_quantized(path, checkpoint_quantization(path))
        load_tensors(model, split_fused(named, model.config), str(path))
    else:
        named = split_fused(iter_safetensors(path), model.config)
        if quantization is not None and quantization.bits:
            named = _quantize_linears(named, quantization)
        load_tensors(model, named, str(path))


def split_fused(named: Iterable[tuple[str, Weight]], cfg: ModelConfig
                ) -> Iterator[tuple[str, Weight]]:
    """Phi-3's fused qkv_proj / gate_up_proj as the separate q/k/v, gate/up weights, in every
    checkpoint format: cut by rows, a QuantizedWeight keeping its blocks."""
    for name, weight in named:
        match = _FUSED.fullmatch(name)
        if match is None:
            yield name, weight
            continue
        prefix, rows = match[1], weight.shape[0]
        if match[2] == "mlp.gate_up_proj":
            parts = {"mlp.gate_proj": rows // 2, "mlp.up_proj": rows // 2}
        else:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            parts = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv}
        if sum(parts.values()) != rows:
            raise ValueError(f"{name}: {rows} rows do not split into "
                             f"{' / '.join(parts)} of {' / '.join(map(str, parts.values()))}")
        start = 0
        for part, size in parts.items():
            piece = weight.narrow(0, start, size)
            if isinstance(piece, torch.Tensor):
                piece = piece.clone()  # a dense part owns its memory, not its siblings'
            yield f"{prefix}{part}.weight", piece
            start += size


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
    rules = [*getattr(model, "weight_rules", ()), *_RULES]
    for name, tensor in named:
        if _IGNORED.match(name) or (tied and name == "lm_head.weight"):
            continue
        target = _target(name, rules)
        if target is None:
            continue
        module_path, shard, param = target
        model.get_submodule(module_path).load(param, tensor, shard)
        loaded.add(f"{module_path}.{param}")
    missing = expected - loaded
    if missing:
        raise ValueError(f"model: checkpoint {source} lacks {sorted(missing)[:5]}")
    logger.info("loaded %d tensors from %s", len(loaded), source)


def _target(name: str, rules: list) -> tuple[str, str, str] | None:
    """(module path, shard, parameter) of a checkpoint tensor; None: not one the model uses.
    A model class's own `weight_rules` come before the shared ones."""
    for pattern, target in rules:
        match = pattern.fullmatch(name)
        if match:
            return target(match)
    raise ValueError(f"model: unexpected tensor {name!r} in checkpoint")
