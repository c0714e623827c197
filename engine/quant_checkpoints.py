"""GPTQ and AWQ 4-bit safetensors checkpoints, read into the int4 `QuantizedWeight` layout.

Both formats store, per linear `<prefix>`, int32 words of eight 4-bit values (value j at bits
4j), fp16 `scales` [in / group, out] and packed zero points `qzeros` [in / group, out / 8];
w[o, i] = scales[g, o] * (q[i, o] - zero[g, o]) with g = i // group.

- GPTQ (AutoGPTQ / GPTQModel): `qweight` [in / 8, out] packs along the input dimension,
  `qzeros` along the output one; format "gptq" (v1) stores zero - 1, "gptq_v2" the zero itself;
  `g_idx` [in] names each input column's group and must be the trivial i // group.
- AWQ (AutoAWQ, version "gemm"): `qweight` [in, out / 8] and `qzeros` both pack along the
  output dimension, nibble j of word c holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][j].

Into the int4 layout: q unchanged, scale = scales in fp32, offset = -scale * zero in fp32. An
fp16 scale times an integer of at most 5 bits is exact in fp32, so `dequantize` gives the
format's own dequantization exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.kernels.quant_weights import QuantizedWeight, pack_int4

METHODS = ("gptq", "awq")
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_VERSIONS = ("gemm",)
# (file, quant_method assumed when the file names none); config.json's entry comes first
_CONFIG_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))
_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_AWQ_REVERSE_ORDER = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # inverse of [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's quantization_config, as far as loading it needs.

    `group_size` -1 is one group per output channel (spanning in_features). `checkpoint_format`
    is the GPTQ format ("gptq" v1 or "gptq_v2") or the AWQ version ("gemm").
    """

    method: str
    bits: int
    group_size: int
    checkpoint_format: str
    desc_act: bool = False
    sym: bool = True
    zero_point: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization_config.quant_method must be one of {METHODS}, "
                             f"got {self.method!r}")
        if self.bits != 4:
            raise ValueError(f"quantization_config.bits: only 4-bit {self.method} checkpoints "
                             f"are supported, got {self.bits}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError("quantization_config.group_size must be > 0 or -1 (per channel), "
                             f"got {self.group_size}")
        formats = GPTQ_FORMATS if self.method == "gptq" else AWQ_VERSIONS
        field = "checkpoint_format" if self.method == "gptq" else "version"
        if self.checkpoint_format not in formats:
            raise ValueError(f"quantization_config.{field}: {self.method} format "
                             f"{self.checkpoint_format!r} is not supported (only {formats}); "
                             "exllama, marlin, gemv and other kernel-specific packings are not")
        if self.method == "awq" and not self.zero_point:
            raise ValueError("quantization_config.zero_point: AWQ gemm checkpoints without zero "
                             "points are not supported")


def checkpoint_quantization(model_dir: Path) -> CheckpointQuant | None:
    """The GPTQ / AWQ settings of the checkpoint in `model_dir`; None when it is not quantized.

    Read from config.json's `quantization_config`, else AutoGPTQ's quantize_config.json, else
    AutoAWQ's quant_config.json. Any other quant_method is refused.
    """
    model_dir = Path(model_dir)
    found = _raw_config(model_dir)
    if found is None:
        return None
    raw, default_method = found
    method = str(raw.get("quant_method", default_method)).lower()
    if method not in METHODS:
        raise ValueError(f"quantization_config.quant_method: {method!r} checkpoints are not "
                         f"supported (only {METHODS})")
    if raw.get("is_marlin_format"):
        raise ValueError("quantization_config.is_marlin_format: marlin-packed GPTQ checkpoints "
                         "are not supported")
    if raw.get("dynamic"):
        raise ValueError("quantization_config.dynamic: per-module quantization overrides are "
                         "not supported")
    if method == "gptq":
        fmt = raw.get("checkpoint_format") or raw.get("format") or "gptq"
    else:
        fmt = raw.get("version") or raw.get("format") or "gemm"
    return CheckpointQuant(
        method=method,
        bits=int(_first(raw, "bits", "w_bit", default=4)),
        group_size=int(_first(raw, "group_size", "q_group_size", default=128)),
        checkpoint_format=str(fmt).lower(),
        desc_act=bool(raw.get("desc_act", False)),
        sym=bool(raw.get("sym", True)),
        zero_point=bool(raw.get("zero_point", True)),
    )


def _raw_config(model_dir: Path) -> tuple[dict, str] | None:
    config = model_dir / "config.json"
    if config.is_file():
        raw = json.loads(config.read_text()).get("quantization_config")
        if raw:
            return raw, "gptq"
    for name, method in _CONFIG_FILES:
        if (model_dir / name).is_file():
            return json.loads((model_dir / name).read_text()), method
    return None


def _first(raw: dict, *keys: str, default: int) -> int:
    return next((raw[k] for k in keys if raw.get(k) is not None), default)


def iter_quantized(
    model_dir: Path, quant: CheckpointQuant
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Every tensor of the *.safetensors files in `model_dir`, by Hugging Face name.

    Each quantized linear's `<prefix>.qweight`, `.qzeros`, `.scales` (and GPTQ `.g_idx`) come
    as one int4 `QuantizedWeight` named `<prefix>.weight`, once all its parts are read (they
    may sit in different files); every other tensor passes through unchanged.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_dir}")
    keys = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys[file] = list(f.keys())
    names = {name for file_keys in keys.values() for name in file_keys}
    prefixes = {n.removesuffix(".qweight") for n in names if n.endswith(".qweight")}
    parts = {p: _needed_parts(p, names, quant) for p in prefixes}
    pending: dict[str, dict[str, torch.Tensor]] = {p: {} for p in prefixes}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in keys[file]:
                prefix, _, part = name.rpartition(".")
                if prefix not in parts or part not in parts[prefix]:
                    yield name, f.get_tensor(name)
                    continue
                pending[prefix][part] = f.get_tensor(name)
                if len(pending[prefix]) == len(parts[prefix]):
                    yield f"{prefix}.weight", convert_linear(prefix, pending.pop(prefix), quant)


def _needed_parts(prefix: str, names: set[str], quant: CheckpointQuant) -> tuple[str, ...]:
    needed = ("qweight", "qzeros", "scales")
    missing = [p for p in needed if f"{prefix}.{p}" not in names]
    if missing:
        raise ValueError(f"{prefix}.qweight: the checkpoint lacks its "
                         f"{', '.join(f'{prefix}.{p}' for p in missing)}")
    has_g_idx = quant.method == "gptq" and f"{prefix}.g_idx" in names
    return (*needed, "g_idx") if has_g_idx else needed


def convert_linear(
    prefix: str, parts: dict[str, torch.Tensor], quant: CheckpointQuant
) -> QuantizedWeight:
    """One linear's GPTQ / AWQ tensors (`qweight`, `qzeros`, `scales`, optional `g_idx`) as an
    int4 `QuantizedWeight` [out, in]."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    for part in ("qweight", "qzeros"):
        if parts[part].dtype != torch.int32 or parts[part].dim() != 2:
            raise ValueError(f"{prefix}.{part} must be a 2-D int32 tensor, got "
                             f"{parts[part].dtype} {list(parts[part].shape)}")
    if quant.method == "gptq":
        in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
        q = _unpack_rows(qweight)
    else:
        in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
        q = _unpack_cols(qweight, awq=True)
    group = in_features if quant.group_size == -1 else quant.group_size
    if in_features % group or in_features % 2:
        raise ValueError(f"{prefix}.qweight: in_features {in_features} must be even and a "
                         f"multiple of quantization_config.group_size {group}")
    groups = in_features // group
    _check_shape(prefix, "scales", scales, (groups, out_features))
    _check_shape(prefix, "qzeros", qzeros, (groups, out_features // 8))
    if not scales.is_floating_point():
        raise ValueError(f"{prefix}.scales must be floating point, got {scales.dtype}")
    if "g_idx" in parts:
        _check_g_idx(prefix, parts["g_idx"], in_features, group)
    zeros = _unpack_cols(qzeros, awq=quant.method == "awq")
    if quant.checkpoint_format == "gptq":
        zeros = zeros + 1  # v1 stores zero - 1
    scale = scales.float().t().contiguous()
    offset = -(scale * zeros.float().t())
    return QuantizedWeight(4, group, pack_int4(q.t()).contiguous(), scale, offset.contiguous())


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [r, c] -> [8r, c]: value j of word (k, c) is row 8k + j."""
    nibbles = (packed[:, None, :] >> _SHIFTS[None, :, None]) & 0xF
    return nibbles.reshape(packed.shape[0] * 8, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, awq: bool) -> torch.Tensor:
    """int32 [r, c] -> [r, 8c]: value j of word (r, k) is column 8k + j (AWQ: 8k + order[j])."""
    nibbles = (packed[:, :, None] >> _SHIFTS) & 0xF
    if awq:
        nibbles = nibbles[..., _AWQ_REVERSE_ORDER]
    return nibbles.reshape(packed.shape[0], packed.shape[1] * 8)


def _check_shape(prefix: str, part: str, tensor: torch.Tensor, want: tuple[int, int]) -> None:
    if tuple(tensor.shape) != want:
        raise ValueError(f"{prefix}.{part} must be {list(want)} for its qweight, got "
                         f"{list(tensor.shape)}")


def _check_g_idx(prefix: str, g_idx: torch.Tensor, in_features: int, group: int) -> None:
    trivial = torch.arange(in_features, device=g_idx.device) // group
    if tuple(g_idx.shape) != (in_features,):
        raise ValueError(f"{prefix}.g_idx must be [{in_features}], got {list(g_idx.shape)}")
    if not torch.equal(g_idx.long(), trivial):
        raise ValueError(f"{prefix}.g_idx: act-order (desc_act) groups that are not the "
                         f"contiguous i // {group} are not supported; the int4 layout needs "
                         "each group to be a contiguous run of input columns (re-quantize with "
                         "desc_act false or static_groups true)")
