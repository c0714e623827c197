"""Causal attention of a chunk of query tokens per sequence against its paged KV.

The chunk's own K/V are already stored in the cache, so cached prefix blocks (prefix-cache
hits, earlier chunks of a chunked prefill) and the new tokens are read the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.paged_decode_attention import gather_kv


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences concatenated
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. the chunk
    scale: float,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = context_lens.shape[0]
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    if max_query_len is None:
        max_query_len = int(query_lens.max())
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    device = q.device

    # Scatter the ragged queries into a padded [S, max_q] grid.
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)
    row_of_token = torch.arange(num_tokens, device=device) - query_start_loc[seq_of_token].long()
    k = gather_kv(k_cache, block_tables, -(-max_context_len // block_size))  # [S, Hkv, L, D]
    v = gather_kv(v_cache, block_tables, -(-max_context_len // block_size))
    qp = q.new_zeros(num_seqs, max_query_len, num_heads, head_dim, dtype=k.dtype)
    qp[seq_of_token, row_of_token] = q.to(k.dtype)
    # [S, Hkv, group * max_q, D]: the query heads sharing a KV head stacked as rows.
    qg = qp.view(num_seqs, max_query_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(num_seqs, num_kv_heads, group * max_query_len, head_dim)

    # Query row j of sequence s sits at absolute position context_len - query_len + j.
    q_pos = (context_lens.long() - query_lens)[:, None] + torch.arange(max_query_len, device=device)
    k_pos = torch.arange(k.shape[2], device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, max_q, L]; padded rows stay finite
    mask = mask[:, None, None].expand(num_seqs, 1, group, max_query_len, k.shape[2])
    mask = mask.reshape(num_seqs, 1, group * max_query_len, k.shape[2])

    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    out = out.view(num_seqs, num_kv_heads, group, max_query_len, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_seqs, max_query_len, num_heads, head_dim)
    return out[seq_of_token, row_of_token].to(q.dtype)
