"""A LoRA adapter in PEFT's on-disk format, checked against the base model, then read.

PEFT writes `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `target_modules`, ...) and
`adapter_model.safetensors` holding, per adapted linear, `...layers.<i>.<self_attn|mlp>.
<module>.lora_A.weight` [r, in] and `lora_B.weight` [out, r]; the linear then computes
W x + scaling * B A x, scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).

`check_adapter` reads the config and the tensors' shapes only (no torch: the router checks an
adapter before any worker loads it); `load_adapter` reads the tensors onto the engine's
linears: each PEFT module mapped to our fused linear and its slice (q_proj to qkv_proj's q,
Phi-3's fused qkv_proj to all three), B scaled once at load.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.config import ModelConfig, is_moe_layer
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.models import MODELS

if TYPE_CHECKING:
    import torch

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
LORA_FAMILIES = ("llama", "gemma")  # model modules (engine.models.MODELS) whose linears adapt
# PEFT module -> (our linear, its slices that the module's B rows cover, in order)
MODULES = {
    "q_proj": ("self_attn.qkv_proj", ("q",)),
    "k_proj": ("self_attn.qkv_proj", ("k",)),
    "v_proj": ("self_attn.qkv_proj", ("v",)),
    "qkv_proj": ("self_attn.qkv_proj", ("q", "k", "v")),  # Phi-3
    "o_proj": ("self_attn.o_proj", ("",)),
    "gate_proj": ("mlp.gate_up_proj", ("gate",)),
    "up_proj": ("mlp.gate_up_proj", ("up",)),
    "gate_up_proj": ("mlp.gate_up_proj", ("gate", "up")),  # Phi-3
    "down_proj": ("mlp.down_proj", ("",)),
}
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")
# config fields whose non-default value changes the math in ways this server does not run
_REFUSED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
            "rank_pattern": {}, "alpha_pattern": {}}


@dataclass(frozen=True)
class LoRAAdapterConfig:
    rank: int
    scaling: float


# (layer, our linear) -> {slice: (A [r, in], B [slice rows, r] scaled)}
LoRAWeights = dict[tuple[int, str], dict[str, tuple["torch.Tensor", "torch.Tensor"]]]


@dataclass(frozen=True)
class LoRAAdapter:
    lora: LoRARequest
    rank: int
    weights: LoRAWeights


def check_adapter(path: str, model: ModelConfig, max_rank: int) -> LoRAAdapterConfig:
    """The adapter at `path`, checked against `model` without loading it: ValueError naming
    what is wrong (a missing file, a rank above `max_rank`, a module the base lacks, a shape
    of another base model)."""
    if MODELS[model.architecture][0] not in LORA_FAMILIES:
        raise ValueError(f"lora_path: adapters map onto the Llama family's linears; "
                         f"{model.architecture}'s layers (latent attention, biased experts) "
                         "take none")
    config = _read_config(Path(path), max_rank)
    for name, (layer, module, kind, shape) in _tensor_shapes(Path(path)).items():
        want = _expected_shape(model, layer, module, kind, config.rank)
        if want is None:
            raise ValueError(f"lora_path: {name}: the base model ({model.architecture}, "
                             f"{model.num_layers} layers) has no {module} in layer {layer}")
        if tuple(shape) != want:
            raise ValueError(f"lora_path: {name} has shape {list(shape)}, the base model "
                             f"needs {list(want)}: an adapter of another base model?")
    return config


def load_adapter(lora: LoRARequest, model: ModelConfig, max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """The adapter's tensors (checked first), in host memory, as the engine's linears take
    them: per (layer, linear) and slice, A and B * scaling in `dtype`."""
    from safetensors.torch import load_file

    config = check_adapter(lora.lora_path, model, max_rank)
    tensors = load_file(str(Path(lora.lora_path) / WEIGHTS_FILE))
    weights: LoRAWeights = {}
    for name, a in tensors.items():
        m = _TENSOR.search(name)
        if m[4] != "A":
            continue
        layer, module = int(m[1]), m[3]
        b = tensors[name[: -len("lora_A.weight")] + "lora_B.weight"].float() * config.scaling
        linear, slices = MODULES[module]
        bs = b.split([_slice_rows(model, s) for s in slices]) if len(slices) > 1 else (b,)
        parts = weights.setdefault((layer, linear), {})
        for s, part in zip(slices, bs, strict=True):
            parts[s] = (a.to(dtype).contiguous(), part.to(dtype).contiguous())
    return LoRAAdapter(lora, config.rank, weights)


def _read_config(path: Path, max_rank: int) -> LoRAAdapterConfig:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise ValueError(f"lora_path: no {CONFIG_FILE} in {str(path)!r}: not a PEFT adapter "
                         "directory (or not on this machine)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"lora_path: {CONFIG_FILE} unreadable: {e}") from None
    kind = config.get("peft_type", "LORA") if isinstance(config, dict) else type(config).__name__
    if kind != "LORA":
        raise ValueError(f"lora_path: {CONFIG_FILE} is not a LoRA adapter's ({kind!r})")
    for key, default in _REFUSED.items():
        if (config.get(key) or default) != default:
            raise ValueError(f"lora_path: {CONFIG_FILE} sets {key}={config[key]!r}, which this "
                             f"server does not run (only {default!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_path: {CONFIG_FILE} r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"lora_path: the adapter's rank {rank} is above max_lora_rank "
                         f"({max_rank}): raise --max-lora-rank")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"lora_path: {CONFIG_FILE} lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return LoRAAdapterConfig(rank, scaling)


def _tensor_shapes(path: Path) -> dict[str, tuple[int, str, str, list[int]]]:
    """name -> (layer, PEFT module, "A" or "B", shape), each A with its B."""
    from safetensors import safe_open

    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise ValueError(f"lora_path: no {WEIGHTS_FILE} in {str(path)!r}")
    shapes = {}
    try:
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                m = _TENSOR.search(name)
                if m is None or m[3] not in MODULES:
                    raise ValueError(f"lora_path: {name}: not a LoRA weight of a module this "
                                     f"server adapts ({', '.join(MODULES)})")
                shapes[name] = (int(m[1]), m[3], m[4], f.get_slice(name).get_shape())
    except (OSError, RuntimeError) as e:  # safetensors' own errors are RuntimeError kin
        raise ValueError(f"lora_path: {WEIGHTS_FILE} unreadable: {e}") from None
    for name, (_, _, kind, _) in shapes.items():
        pair = name[: -len("A.weight")] + ("B.weight" if kind == "A" else "A.weight")
        if pair not in shapes:
            raise ValueError(f"lora_path: {name} has no {pair}")
    if not shapes:
        raise ValueError(f"lora_path: {WEIGHTS_FILE} holds no LoRA weights")
    return shapes


def _slice_rows(model: ModelConfig, slice_name: str) -> int:
    """Output rows of one slice of our fused linears (the base's full, unsharded size)."""
    d = model.head_dim
    return {"q": model.num_heads * d, "k": model.num_kv_heads * d, "v": model.num_kv_heads * d,
            "gate": model.intermediate_size, "up": model.intermediate_size}[slice_name]


def _expected_shape(model: ModelConfig, layer: int, module: str, kind: str,
                    rank: int) -> tuple[int, int] | None:
    """The shape of a module's lora_A / lora_B in `model`; None where the base lacks it."""
    linear, slices = MODULES[module]
    if not 0 <= layer < model.num_layers or (linear.startswith("mlp.")
                                             and is_moe_layer(model, layer)):
        return None
    hidden, attention = model.hidden_size, model.num_heads * model.head_dim
    if linear == "self_attn.o_proj":
        fan_in, fan_out = attention, hidden
    elif linear == "mlp.down_proj":
        fan_in, fan_out = model.intermediate_size, hidden
    else:
        fan_in, fan_out = hidden, sum(_slice_rows(model, s) for s in slices)
    return (rank, fan_in) if kind == "A" else (fan_out, rank)
