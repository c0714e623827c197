"""The K/V store on the CPU: a step's rows copied to their slots in one C call
(`store_kv.c`)."""

from __future__ import annotations

import torch

from pdserve.kernels.cpu import build
from pdserve.kernels.reference.store_kv import store_kv_ref


def _kernel():
    return build.function("store_kv", "store_kv", (build.PTR, build.I64) * 2
                           + (build.PTR,) * 3 + (build.I64,) * 3, build.INT)


def store_kv_cpu(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset
) -> None:
    """`store_kv_ref` in one C call (`store_kv.c`) where the rows copy as they are (same
    dtype, each token's heads contiguous); anything else goes to the reference."""
    kernel = _kernel()
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    row = num_kv_heads * head_dim
    plain = (
        kernel is not None and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
        and key.shape == value.shape == (slot_mapping.shape[0], num_kv_heads, head_dim)
        and all(t.stride()[1:] == (head_dim, 1) for t in (key, value))
        and k_cache.is_contiguous() and v_cache.is_contiguous()
        and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    )
    if not plain:
        return store_kv_ref(key, value, k_cache, v_cache, slot_mapping)
    size = k_cache.element_size()
    rc = kernel(key.data_ptr(), key.stride(0) * size, value.data_ptr(), value.stride(0) * size,
                k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
                slot_mapping.shape[0], num_blocks * block_size, row * size)
    if rc != 0:
        raise IndexError(f"store_kv: a slot is past the cache's {num_blocks * block_size}")
