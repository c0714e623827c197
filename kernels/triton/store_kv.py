"""Write new K/V rows into the paged cache at the slots given by a slot mapping.

`store_kv_int8` quantizes on the way in to the format of `kernels.kv_quant` (int8 values plus
one fp16 scale per token and KV head). The Triton kernel skips negative slots (padding tokens);
the torch path expects every slot valid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_kv_cache,
    check_kv_scales,
    check_last_contiguous,
    check_shape,
)
from pdserve.kernels.kv_quant import MAX_SCALE, MIN_SCALE, QMAX
from pdserve.kernels.triton.launch import pow2

# Kernels may read module globals only as constexprs.
_QMAX = tl.constexpr(QMAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)
_MAX_SCALE = tl.constexpr(MAX_SCALE)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr, v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] (int8 caches only)
    slot_mapping_ptr,  # [num_tokens] int64
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    stride_sb, stride_st, stride_sh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, QUANT: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src_k = key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    dst = block * stride_cb + offset * stride_ct + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(src_k, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(src_v, mask=mask, other=0.0).to(tl.float32)
    if QUANT:
        # Round the scale to fp16 first: dequantization must see the scale used here.
        k_s = tl.clamp(tl.max(tl.abs(k), axis=1) / _QMAX, _MIN_SCALE, _MAX_SCALE)
        v_s = tl.clamp(tl.max(tl.abs(v), axis=1) / _QMAX, _MIN_SCALE, _MAX_SCALE)
        k_s = k_s.to(tl.float16).to(tl.float32)
        v_s = v_s.to(tl.float16).to(tl.float32)
        k = tl.clamp(tl.floor(k / k_s[:, None] + 0.5), -_QMAX, _QMAX)
        v = tl.clamp(tl.floor(v / v_s[:, None] + 0.5), -_QMAX, _QMAX)
        s_off = block * stride_sb + offset * stride_st + heads * stride_sh
        s_mask = heads < NUM_KV_HEADS
        tl.store(k_scale_ptr + s_off, k_s.to(k_scale_ptr.dtype.element_ty), mask=s_mask)
        tl.store(v_scale_ptr + s_off, v_s.to(v_scale_ptr.dtype.element_ty), mask=s_mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_store_args(key, value, k_cache, v_cache, slot_mapping, quantized):
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache, quantized)
    check_shape("key", key, (None, num_kv_heads, head_dim))
    check_shape("value", value, tuple(key.shape))
    check_dtype("key", key, FLOAT_DTYPES)
    check_dtype("value", value, FLOAT_DTYPES)
    check_last_contiguous("key", key)
    check_last_contiguous("value", value)
    check_shape("slot_mapping", slot_mapping, (key.shape[0],))
    check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides (allocate them alike)")
    check_device(k_cache.device, key=key, value=value, v_cache=v_cache, slot_mapping=slot_mapping)


def _launch(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    quantized = k_scale is not None
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if key.shape[0] == 0:
        return
    scales = (k_scale, v_scale) if quantized else (k_cache, v_cache)  # unused when not QUANT
    scale_strides = k_scale.stride() if quantized else (0, 0, 0)
    _store_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, *scales, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *scale_strides,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=pow2(num_kv_heads), DIM_PAD=pow2(head_dim), QUANT=quantized,
    )


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset
) -> None:
    _check_store_args(key, value, k_cache, v_cache, slot_mapping, quantized=False)
    _launch(key, value, k_cache, v_cache, None, None, slot_mapping)


def store_kv_int8(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] float
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] float
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] int8
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] int8
    k_scale: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] fp16
    v_scale: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] fp16
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    _check_store_args(key, value, k_cache, v_cache, slot_mapping, quantized=True)
    check_kv_scales(k_scale, v_scale, k_cache)
    _launch(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)


