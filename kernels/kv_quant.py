"""The int8 KV-cache format: symmetric int8 values with one fp16 scale per (token, KV head).

Per layer an int8 cache is four tensors:

    k_cache, v_cache  int8     [num_blocks, block_size, num_kv_heads, head_dim]  (same layout
                                                                                 as a float cache)
    k_scale, v_scale  float16  [num_blocks, block_size, num_kv_heads]

and a stored row is `x ~= q * scale` with `scale = max|x| / 127` (rounded to fp16 *before*
quantizing, so dequantization uses exactly the scale the values were quantized with),
`q = clamp(floor(x / scale + 0.5), -127, 127)`.

Why this granularity: a token's K/V are written once, when it is computed, and never touched
again, so a per-token scale needs no requantization as a block fills over many decode steps;
a per-KV-head scale lets a transfer reshard heads between TP layouts (`pack_blocks` moves the
scales with `scale.unsqueeze(-1)` as a head_dim-1 cache). Per token and layer an int8 cache
costs `2 * num_kv_heads * (head_dim + 2)` bytes against `2 * num_kv_heads * 2 * head_dim` for
fp16: ratio `(head_dim + 2) / (2 * head_dim)` = 0.516 at head_dim 64, 0.508 at 128.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16
QMAX = 127.0
# Smallest normal fp16: a near-zero row keeps a representable scale (error <= 2**-15).
MIN_SCALE = 2.0**-14
MAX_SCALE = 65504.0


def quantize_kv_ref(
    x: torch.Tensor,  # [..., head_dim] float
) -> tuple[torch.Tensor, torch.Tensor]:  # (int8 [..., head_dim], fp16 scale [...])
    """Quantize rows of K or V to the int8 format (the oracle for `store_kv_int8`)."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    scale = (amax / QMAX).clamp(MIN_SCALE, MAX_SCALE).to(SCALE_DTYPE)
    q = torch.floor(xf / scale.to(torch.float32)[..., None] + 0.5).clamp(-QMAX, QMAX)
    return q.to(torch.int8), scale


def dequantize_kv_ref(
    q: torch.Tensor,  # [..., head_dim] int8
    scale: torch.Tensor,  # [...] fp16 or fp32
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [..., head_dim] dtype
    return (q.to(torch.float32) * scale.to(torch.float32)[..., None]).to(dtype)


def kv_cache_bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token occupies in one layer's K and V caches (scales included for int8)."""
    if dtype == torch.int8:
        return 2 * num_kv_heads * (head_dim + SCALE_DTYPE.itemsize)
    return 2 * num_kv_heads * head_dim * dtype.itemsize


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, ...]:
    """One layer's cache, zero-filled: (k, v) for a float dtype, (k, v, k_scale, v_scale) for int8.

    Zero-filled matters for the torch path, which reads the unused tail of a sequence's last
    block with zero attention weight: garbage there must be finite (0 * NaN is NaN).
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.zeros(shape, dtype=dtype, device=device)
    v = torch.zeros(shape, dtype=dtype, device=device)
    if dtype != torch.int8:
        return k, v
    k_scale = torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device)
    v_scale = torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device)
    return k, v, k_scale, v_scale
