"""Write tiny GPTQ / AWQ 4-bit checkpoints, packed word by word from the format descriptions.

Each linear is drawn as unpacked q [in, out] in 0..15, real zero points [in / group, out] and
fp16 scales [in / group, out], so a test can dequantize them the format's way,
w[o, i] = scale[g, o] * (q[i, o] - zero[g, o]), without reading the packed words back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds column 8k + AWQ_ORDER[j]


@dataclass(frozen=True)
class Linear:
    """One quantized linear, unpacked: q [in, out], zero [groups, out], scale fp16 [groups, out]."""

    q: torch.Tensor
    zero: torch.Tensor
    scale: torch.Tensor
    group: int

    def reference(self) -> torch.Tensor:
        """The fp32 [out, in] matrix, per the format: scale[g, o] * (q[i, o] - zero[g, o])."""
        g = torch.arange(self.q.shape[0]) // self.group
        return (self.scale.float()[g] * (self.q - self.zero[g]).float()).t()

    def reference_fp16(self) -> torch.Tensor:
        """The same in fp16 arithmetic, as the formats' own torch dequantization computes it."""
        g = torch.arange(self.q.shape[0]) // self.group
        return (self.scale[g] * (self.q - self.zero[g]).half()).t()


def random_linear(in_f: int, out_f: int, group: int, zero_range: tuple[int, int],
                  gen: torch.Generator) -> Linear:
    """Random q, zeros in `zero_range` (inclusive) and fp16 scales spanning several octaves."""
    groups = in_f // group
    q = torch.randint(0, 16, (in_f, out_f), generator=gen)
    zero = torch.randint(zero_range[0], zero_range[1] + 1, (groups, out_f), generator=gen)
    scale = (torch.rand(groups, out_f, generator=gen) * 0.02 + 1e-3).half()
    return Linear(q, zero, scale, group)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (held in int64) as the int32 bit patterns checkpoints store."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_rows(values: torch.Tensor) -> torch.Tensor:
    """[8r, c] values in 0..15 -> int32 [r, c]: row 8k + j at bits 4j of word k (GPTQ qweight)."""
    words = torch.zeros(values.shape[0] // 8, values.shape[1], dtype=torch.int64)
    for j in range(8):
        words |= values[j::8].long() << (4 * j)
    return _to_int32(words)


def pack_along_cols(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[r, 8c] values in 0..15 -> int32 [r, c]: column 8k + order[j] at bits 4j of word k."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for j in range(8):
        words |= values[:, order[j]::8].long() << (4 * j)
    return _to_int32(words)


def gptq_tensors(prefix: str, lin: Linear, g_idx: torch.Tensor | None = None,
                 v1: bool = True) -> dict[str, torch.Tensor]:
    """AutoGPTQ's tensors: qweight [in/8, out], qzeros [groups, out/8] (v1: zero - 1), scales,
    g_idx (the trivial i // group unless given)."""
    in_f = lin.q.shape[0]
    if g_idx is None:
        g_idx = torch.arange(in_f, dtype=torch.int32) // lin.group
    return {f"{prefix}.qweight": pack_along_rows(lin.q),
            f"{prefix}.qzeros": pack_along_cols(lin.zero - 1 if v1 else lin.zero),
            f"{prefix}.scales": lin.scale, f"{prefix}.g_idx": g_idx.to(torch.int32)}


def awq_tensors(prefix: str, lin: Linear) -> dict[str, torch.Tensor]:
    """AutoAWQ gemm's tensors: qweight [in, out/8], qzeros [groups, out/8], scales."""
    return {f"{prefix}.qweight": pack_along_cols(lin.q, AWQ_ORDER),
            f"{prefix}.qzeros": pack_along_cols(lin.zero, AWQ_ORDER),
            f"{prefix}.scales": lin.scale}


def dense_tensors(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The tensors a quantized checkpoint keeps dense: embeddings, norms, lm_head, a bias."""
    return {"model.embed_tokens.weight": torch.randn(40, 32, generator=gen).half(),
            "model.layers.0.input_layernorm.weight": torch.rand(32, generator=gen).half(),
            "model.norm.weight": torch.rand(32, generator=gen).half(),
            "model.layers.0.self_attn.q_proj.bias": torch.randn(32, generator=gen).half(),
            "lm_head.weight": torch.randn(40, 32, generator=gen).half()}


def write_checkpoint(out: Path, quantization_config: dict | None,
                     files: list[dict[str, torch.Tensor]],
                     separate_config: str | None = None) -> Path:
    """config.json (+ `quantization_config`, or that dict in the file `separate_config`) and one
    safetensors file per dict in `files`."""
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32}
    if quantization_config is not None and separate_config is None:
        config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    if quantization_config is not None and separate_config is not None:
        (out / separate_config).write_text(json.dumps(quantization_config))
    for n, tensors in enumerate(files):
        save_file(tensors, str(out / f"model-{n + 1:05d}-of-{len(files):05d}.safetensors"))
    return out
