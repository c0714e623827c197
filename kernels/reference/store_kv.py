"""Write new K/V rows into the paged cache at the slots given by a slot mapping.

`store_kv_int8_ref` quantizes on the way in to the format of `kernels.kv_quant` (int8 values
plus one fp16 scale per token and KV head). Every slot must be valid here.
"""

from __future__ import annotations

import torch

from pdserve.kernels.kv_quant import quantize_kv_ref


def store_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, key.to(k_cache.dtype)
    )
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, value.to(v_cache.dtype)
    )


def store_kv_int8_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] float
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] float
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] int8
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] int8
    k_scale: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] fp16
    v_scale: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] fp16
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    k_q, k_s = quantize_kv_ref(key)
    v_q, v_s = quantize_kv_ref(value)
    store_kv_ref(k_q, v_q, k_cache, v_cache, slot_mapping)
    num_slots = k_scale.shape[0] * k_scale.shape[1]
    k_scale.view(num_slots, -1).index_copy_(0, slot_mapping, k_s.to(k_scale.dtype))
    v_scale.view(num_slots, -1).index_copy_(0, slot_mapping, v_s.to(v_scale.dtype))
