"""Rotary embedding tables for the `rope_type`s Llama-family, Phi-3 and Gemma checkpoints use.

Each variant gives inverse frequencies and an attention scaling; the table holds
cos/sin(position * inv_freq) * scaling in float32, halves duplicated (rotate-half layout),
computed the way the reference implementation does so greedy outputs match to the token.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_freq_and_scaling(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int, max_model_len: int
) -> tuple[torch.Tensor, float]:
    """[head_dim // 2] float32 inverse frequencies and the cos/sin scaling factor."""
    rope_type = params.get("rope_type", "default")
    base = float(params.get("rope_theta", 10000.0))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor: only full-dimension rotary is supported")
    dim = head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "dynamic":
        original = params.get("original_max_position_embeddings", max_position_embeddings)
        if max_model_len <= original:  # dynamic NTK only changes past the original window
            return inv_freq, 1.0
        raise ValueError(
            "rope_scaling.rope_type: 'dynamic' beyond the original context is not supported; "
            f"pass max_model_len <= {original}"
        )
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(params, base, dim, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope(params, base, dim, max_position_embeddings, max_model_len)
    raise ValueError(
        f"rope_scaling.rope_type: {rope_type!r} is not supported "
        "(supported: default, linear, dynamic, llama3, yarn, longrope)"
    )


def _longrope(params: dict[str, Any], base: float, dim: int, max_position_embeddings: int,
              max_model_len: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency factors, `short_factor` within the original context and
    `long_factor` beyond it, and an attention scaling from the context's growth.

    transformers picks the factors per forward pass by the sequence's length, so the positions
    of one sequence change frequencies once it outgrows the original context. A paged cache
    can't recompute the K it holds, so the table is fixed by the context served: short factors
    when max_model_len fits the original context (equal to transformers for every sequence),
    long ones otherwise (equal to transformers for every sequence longer than the original)."""
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(
            1 + math.log(factor) / math.log(original))
    ext = params["long_factor"] if max_model_len > original else params["short_factor"]
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base**shape), float(attention_factor)


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Long wavelengths slowed by `factor`, short ones kept, a smooth ramp in between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(
    params: dict[str, Any], base: float, dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, scale attention by mscale."""
    factor = params["factor"]
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(
                factor, params["mscale_all_dim"]
            )
        else:
            attention_factor = mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def rope_tables(
    params: dict[str, Any],
    head_dim: int,
    max_position_embeddings: int,
    max_model_len: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_model_len, rotary_dim] float32."""
    inv_freq, scaling = inv_freq_and_scaling(
        params, head_dim, max_position_embeddings, max_model_len
    )
    positions = torch.arange(max_model_len, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [L, dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(device), (emb.sin() * scaling).to(device)
