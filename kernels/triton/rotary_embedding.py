"""Rotary position embedding (rotate-half / NeoX layout, as Llama, Qwen2 and Mistral use).

The kernel rounds every intermediate to the model dtype exactly where the unfused torch
expression does (`x * cos + rotate_half(x) * sin` with cos/sin cast to the model dtype), so
fp16/bf16 results are bit-identical to Hugging Face's, not merely close.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import FLOAT_DTYPES, check_device, check_dtype, check_shape
from pdserve.kernels.triton.launch import pow2


@triton.jit
def _rotate_heads(ptr, stride_t, stride_h, token, c1, c2, s1, s2,
                  NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                  HALF_PAD: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < NUM_HEADS) & (i[None, :] < HALF)
    lo = ptr + token * stride_t + heads[:, None] * stride_h + i[None, :]
    x1 = tl.load(lo, mask=mask, other=0.0)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # out1 = x1*cos1 - x2*sin1, out2 = x2*cos2 + x1*sin2; each product rounded like torch.
    a1 = (x1 * c1[None, :]).to(dt).to(tl.float32)
    b1 = (x2 * s1[None, :]).to(dt).to(tl.float32)
    a2 = (x2 * c2[None, :]).to(dt).to(tl.float32)
    b2 = (x1 * s2[None, :]).to(dt).to(tl.float32)
    tl.store(lo, (a1 - b1).to(dt), mask=mask)
    tl.store(lo + HALF, (a2 + b2).to(dt), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    positions_ptr,  # [num_tokens]
    cos_ptr, sin_ptr,  # [max_positions, head_dim]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    mask = i < HALF
    dt = q_ptr.dtype.element_ty
    # cos/sin are cast to the model dtype first, as the reference does.
    c1 = tl.load(cos_ptr + pos * stride_cos + i, mask=mask, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_cos + HALF + i, mask=mask, other=0.0)
    c2 = c2.to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * stride_sin + i, mask=mask, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_sin + HALF + i, mask=mask, other=0.0)
    s2 = s2.to(dt).to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, stride_qh, token, c1, c2, s1, s2,
                  NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr, stride_kt, stride_kh, token, c1, c2, s1, s2,
                  NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)


def rotary_embedding(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_positions, head_dim] float32, halves duplicated
    sin_cache: torch.Tensor,  # [max_positions, head_dim] float32
) -> None:
    """Rotate q and k in place."""
    check_shape("q", q, (None, None, None))
    num_tokens, num_heads, head_dim = q.shape
    check_shape("k", k, (num_tokens, None, head_dim))
    check_dtype("q", q, FLOAT_DTYPES)
    check_dtype("k", k, (q.dtype,))
    check_shape("positions", positions, (num_tokens,))
    check_dtype("positions", positions, (torch.int64, torch.int32))
    check_shape("cos_cache", cos_cache, (None, head_dim))
    check_shape("sin_cache", sin_cache, (cos_cache.shape[0], head_dim))
    check_device(q.device, k=k, positions=positions, cos_cache=cos_cache, sin_cache=sin_cache)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    for name, t in (("q", q), ("k", k), ("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in its last dim; pass .contiguous()")
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_embedding_kernel[(num_tokens,)](
        q, k, positions, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0),
        sin_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1], HEADS_PAD=pow2(num_heads),
        KV_HEADS_PAD=pow2(k.shape[1]), HALF=half, HALF_PAD=pow2(half),
    )


