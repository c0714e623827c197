"""One layer's KV blocks of many requests <-> one contiguous transfer buffer, on the GPU.

One program per (block, K or V, token chunk) copies a block's head range between the cache and
the wire buffer; the layout and the argument checks are the reference's
(`kernels.reference.pack_blocks`), so a buffer packed here unpacks there and back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import check_device, check_dtype, check_shape
from pdserve.kernels.reference.pack_blocks import check_pack_args, wire_buffer
from pdserve.kernels.triton.launch import new_output, pow2

TOKENS_PER_PROGRAM = 16


@triton.jit
def _pack_blocks_kernel(
    buffer_ptr,  # [2, n, block_size, num_heads, head_dim], contiguous
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_ids_ptr,  # [n]
    head_start, num_blocks_packed,
    stride_cb, stride_ct, stride_ch, stride_cd,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    TOKENS: tl.constexpr, COLS_PAD: tl.constexpr, UNPACK: tl.constexpr,
):
    i, kv, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    t = chunk * TOKENS + tl.arange(0, TOKENS)
    c = tl.arange(0, COLS_PAD)  # (head, dim) flattened over the packed head range
    mask = (t[:, None] < BLOCK_SIZE) & (c[None, :] < NUM_HEADS * HEAD_DIM)
    head = head_start + c // HEAD_DIM
    cache_off = block * stride_cb + t[:, None] * stride_ct
    cache_off += head[None, :] * stride_ch + (c % HEAD_DIM)[None, :] * stride_cd
    buf_row = (kv * num_blocks_packed + i) * BLOCK_SIZE + t
    buf = buffer_ptr + buf_row[:, None].to(tl.int64) * (NUM_HEADS * HEAD_DIM) + c[None, :]
    if kv == 0:
        _copy(k_cache_ptr + cache_off, buf, mask, UNPACK)
    else:
        _copy(v_cache_ptr + cache_off, buf, mask, UNPACK)


@triton.jit
def _copy(cache, buf, mask, UNPACK: tl.constexpr):
    if UNPACK:
        tl.store(cache, tl.load(buf, mask=mask), mask=mask)
    else:
        tl.store(buf, tl.load(cache, mask=mask), mask=mask)


def _launch(buffer, k_cache, v_cache, block_ids, head_start, head_end, unpack) -> None:
    n = block_ids.shape[0]
    _, block_size, _, head_dim = k_cache.shape
    num_heads = head_end - head_start
    if n == 0:
        return
    tokens = min(TOKENS_PER_PROGRAM, pow2(block_size))
    grid = (n, 2, triton.cdiv(block_size, tokens))
    _pack_blocks_kernel[grid](
        buffer, k_cache, v_cache, block_ids, head_start, n, *k_cache.stride(),
        BLOCK_SIZE=block_size, NUM_HEADS=num_heads, HEAD_DIM=head_dim, TOKENS=tokens,
        COLS_PAD=pow2(num_heads * head_dim), UNPACK=unpack,
    )


def pack_blocks(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64
    head_start: int,
    head_end: int,
    *,
    out: torch.Tensor | None = None,  # reuse this buffer
) -> torch.Tensor:  # [2, n, block_size, head_end - head_start, head_dim], contiguous
    check_pack_args(k_cache, v_cache, block_ids, head_start, head_end)
    buffer = wire_buffer(out, k_cache, block_ids.shape[0], head_start, head_end,
                         new_output)
    _launch(buffer, k_cache, v_cache, block_ids, head_start, head_end, unpack=False)
    return buffer


def unpack_blocks(
    buffer: torch.Tensor,  # [2, n, block_size, head_end - head_start, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64
    head_start: int,
    head_end: int,
) -> None:
    check_pack_args(k_cache, v_cache, block_ids, head_start, head_end)
    _, block_size, _, head_dim = k_cache.shape
    shape = (2, block_ids.shape[0], block_size, head_end - head_start, head_dim)
    check_shape("buffer", buffer, shape)
    check_dtype("buffer", buffer, (k_cache.dtype,))
    check_device(k_cache.device, buffer=buffer)
    if not buffer.is_contiguous():
        raise ValueError("buffer must be contiguous (it is the wire format)")
    _launch(buffer, k_cache, v_cache, block_ids, head_start, head_end, unpack=True)


