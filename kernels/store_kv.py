"""Write new K/V rows into the paged cache at the slots given by a slot mapping."""

from __future__ import annotations

import torch


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
