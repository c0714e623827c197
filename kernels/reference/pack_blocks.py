"""One layer's KV blocks of many requests <-> one contiguous transfer buffer, in plain torch.

The buffer layout (what both ends of a KV transfer agree on, beside the layout id):

    buffer[0] = K, buffer[1] = V                    # [2, n, block_size, heads, head_dim]
    buffer[:, i] = cache[block_ids[i], :, head_start:head_end, :]

contiguous in that order, so `buffer.view(-1)` is the wire format. The head range lets a
prefill rank with TP=p feed decode ranks with TP=d: each side packs or unpacks only the KV
heads the other owns. int8 caches move their scales the same way, as a head_dim-1 cache:
`pack_blocks(k_scale.unsqueeze(-1), v_scale.unsqueeze(-1), ...)`. The argument checks here
serve the Triton kernels too (`kernels.triton.pack_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.kernels.checks import check_device, check_dtype, check_shape


def pack_blocks_ref(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64
    head_start: int,
    head_end: int,
    *,
    out: torch.Tensor | None = None,  # reuse this buffer
) -> torch.Tensor:  # [2, n, block_size, head_end - head_start, head_dim], contiguous
    check_pack_args(k_cache, v_cache, block_ids, head_start, head_end)
    ids = block_ids.long()
    n = ids.shape[0]
    buffer = wire_buffer(out, k_cache, n, head_start, head_end)
    for kv, cache in enumerate((k_cache, v_cache)):
        if head_start == 0 and head_end == cache.shape[2] and cache.is_contiguous():
            # One memcpy per block through the 2-D view (see kernels.reference.paged_attention).
            torch.index_select(cache.view(cache.shape[0], -1), 0, ids, out=buffer[kv].view(n, -1))
        else:
            torch.index_select(cache[:, :, head_start:head_end], 0, ids, out=buffer[kv])
    return buffer


def unpack_blocks_ref(
    buffer: torch.Tensor,  # [2, n, block_size, head_end - head_start, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64, distinct
    head_start: int,
    head_end: int,
) -> None:
    """On CPU, numpy row assignment on byte views: a memcpy per block, where torch's
    index_copy_ goes element by element (one 3 MiB SmolLM2 layer into 128 random blocks, one
    thread: 0.08 ms vs 0.46 ms). Byte views keep it dtype-agnostic (bf16 has no numpy dtype)."""
    check_pack_args(k_cache, v_cache, block_ids, head_start, head_end)
    ids = block_ids.long()
    for kv, cache in enumerate((k_cache, v_cache)):
        src = buffer[kv]
        if cache.device.type != "cpu" or cache.stride(-1) != 1 or not src.is_contiguous():
            cache[ids, :, head_start:head_end] = src
        elif head_start == 0 and head_end == cache.shape[2] and cache.is_contiguous():
            dst = cache.view(cache.shape[0], -1).view(torch.uint8).numpy()
            dst[ids.numpy()] = src.reshape(len(ids), -1).view(torch.uint8).numpy()
        else:  # a head slice: the last dim in bytes keeps every view a plain strided array
            dst = cache.view(torch.uint8).numpy()
            dst[ids.numpy(), :, head_start:head_end] = src.view(torch.uint8).numpy()


def check_pack_args(k_cache, v_cache, block_ids, head_start, head_end) -> None:
    if k_cache.dim() != 4:
        raise ValueError("k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if v_cache.dtype != k_cache.dtype or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must share dtype and strides")
    check_shape("block_ids", block_ids, (None,))
    check_dtype("block_ids", block_ids, (torch.int64, torch.int32))
    if not 0 <= head_start < head_end <= k_cache.shape[2]:
        raise ValueError(f"need 0 <= head_start < head_end <= {k_cache.shape[2]}, "
                         f"got {head_start}, {head_end}")
    check_device(k_cache.device, v_cache=v_cache, block_ids=block_ids)


def wire_buffer(
    out: torch.Tensor | None, k_cache: torch.Tensor, n: int, head_start: int, head_end: int,
    new: Callable[..., torch.Tensor] = torch.empty,
) -> torch.Tensor:
    """The wire buffer: `out` checked, or a new one (`new(shape, dtype=, device=)`). On CPU,
    passing a reused `out` avoids the page faults of fresh multi-MiB memory (they cost ~20x
    the copy: kvtransfer.staging)."""
    _, block_size, _, head_dim = k_cache.shape
    shape = (2, n, block_size, head_end - head_start, head_dim)
    if out is None:
        return new(shape, dtype=k_cache.dtype, device=k_cache.device)
    check_shape("out", out, shape)
    check_dtype("out", out, (k_cache.dtype,))
    check_device(k_cache.device, out=out)
    if not out.is_contiguous():
        raise ValueError("out must be contiguous (it is the wire format)")
    return out
