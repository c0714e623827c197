"""Attention of one query token per sequence against that sequence's paged KV."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    num_blocks_used: int,
) -> torch.Tensor:  # [num_seqs, num_kv_heads, num_blocks_used * block_size, head_dim]
    """Copy each sequence's blocks into one padded, contiguous-per-sequence tensor."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    num_seqs = block_tables.shape[0]
    table = block_tables[:, :num_blocks_used].reshape(-1).long()
    kv = cache.index_select(0, table)  # [num_seqs * num_blocks_used, block_size, H, D]
    kv = kv.view(num_seqs, num_blocks_used * block_size, num_kv_heads, head_dim)
    return kv.transpose(1, 2)


def paged_decode_attention_ref(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. this one
    scale: float,
    max_context_len: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    num_blocks_used = -(-max_context_len // block_size)
    k = gather_kv(k_cache, block_tables, num_blocks_used)  # [S, Hkv, L, D]
    v = gather_kv(v_cache, block_tables, num_blocks_used)
    # Query heads of one KV head become rows of one matrix: no K/V repeat for GQA.
    qg = q.view(num_seqs, num_kv_heads, group, head_dim).to(k.dtype)
    positions = torch.arange(k.shape[2], device=q.device)
    mask = positions[None, :] < context_lens[:, None]  # [S, L]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
