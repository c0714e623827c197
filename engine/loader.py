"""Load HF-format safetensors into our network, each tensor straight into its final slot."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)

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
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Fill every parameter of `model` from the *.safetensors files in `path`."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {path}")
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()
    tied = model.lm_head is model.embed_tokens
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if _IGNORED.match(name) or (tied and name == "lm_head.weight"):
                    continue
                module_path, shard, param = _target(name)
                module = model.get_submodule(module_path)
                module.load(param, f.get_tensor(name), shard)
                loaded.add(f"{module_path}.{param}")
    missing = expected - loaded
    if missing:
        raise ValueError(f"model: checkpoint {path} lacks {sorted(missing)[:5]}")
    logger.info("loaded %d tensors from %d file(s) in %s", len(loaded), len(files), path)


def _target(name: str) -> tuple[str, str, str]:
    for pattern, target in _RULES:
        match = pattern.fullmatch(name)
        if match:
            return target(match)
    raise ValueError(f"model: unexpected tensor {name!r} in checkpoint")
