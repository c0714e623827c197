"""Which weight quantization a model is served with, decided once from the request and the files.

`quantization`, as vLLM's argument:
- None: as the checkpoint is (dense, or the GPTQ/AWQ its config.json names).
- "int8" / "int4": round-to-nearest weight-only quantization of every linear layer at load
  (int8 per output channel; int4 group-wise with offsets, `quantization_group_size`, default
  32). Embeddings and the LM head stay in the serving dtype.
- "gguf": the weights of the directory's *.gguf file as its blocks are (Q4_0/Q4_1 as int4,
  Q8_0 as int8), never dequantized to a dense copy except the embedding table; the types no
  kernel runs (Q5_0/Q5_1 and the K-quants of Q4_K_M / Q5_K_M files) load dense, dequantized.
- "gptq" / "awq": a 4-bit checkpoint in that packing (found from config.json on its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

METHODS = ("int8", "int4", "gguf", "gptq", "awq")
ROUND_TO_NEAREST = {"int8": 8, "int4": 4}  # method -> bits, quantized at load


@dataclass(frozen=True)
class Quantization:
    method: str
    group_size: int = 0  # RTN only; 0: the bit width's default

    @property
    def bits(self) -> int | None:
        return ROUND_TO_NEAREST.get(self.method)


def resolve_quantization(requested: str | None, checkpoint_method: str | None,
                         has_gguf: bool, group_size: int = 0) -> Quantization | None:
    """The quantization to serve with; ValueError naming `quantization` when it can't be."""
    if requested is not None and requested not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS} or None, got {requested!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 0:
        raise ValueError(f"quantization_group_size must be an int >= 0, got {group_size!r}")
    if group_size and requested not in ROUND_TO_NEAREST:
        raise ValueError("quantization_group_size applies to quantization='int8' or 'int4' "
                         f"only, got quantization={requested!r}")
    if checkpoint_method is not None:
        if checkpoint_method not in ("gptq", "awq"):
            raise ValueError(f"quantization_config.quant_method: {checkpoint_method!r} "
                             "checkpoints are not supported (gptq and awq are)")
        if requested not in (None, checkpoint_method):
            raise ValueError(f"quantization={requested!r}, but the checkpoint is already "
                             f"quantized with {checkpoint_method}: pass None or "
                             f"{checkpoint_method!r}")
        return Quantization(checkpoint_method)
    if requested in ("gptq", "awq"):
        raise ValueError(f"quantization={requested!r}: the checkpoint's config.json has no "
                         f"{requested} quantization_config")
    if requested == "gguf" and not has_gguf:
        raise ValueError("quantization='gguf': the model directory holds no *.gguf file")
    return None if requested is None else Quantization(requested, group_size)


def checkpoint_method(hf_config: object) -> str | None:
    """config.json's quantization_config.quant_method, lower-cased; None if unquantized."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method)).lower() if method is not None else None


def has_gguf(path: str | Path) -> bool:
    return any(Path(path).glob("*.gguf"))
