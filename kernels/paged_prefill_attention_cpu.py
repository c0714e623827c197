"""Paged prefill attention on the CPU: one SDPA call per sequence, causal where it can be.

The reference (`paged_kv.prefill_attention_torch`) pads every sequence of the step to the
longest query and context and attends under an explicit mask, so a step's cost is
num_seqs x max_query x max_context whatever the lengths; with the heads that share a KV head
stacked as rows, the mask is not causal in shape and SDPA skips nothing. A step of eleven
ShareGPT-like prompts (48 to 485 tokens) did ~9x the work the prompts need.

Here each sequence attends alone, over its own blocks only: a whole prompt (no cached prefix)
with `is_causal` (the flash kernel skips the masked half), a chunk after a cached prefix under
a bottom-right mask of its own size. GQA is SDPA's `enable_gqa`: K/V are never repeated. Same
signature and numerics as `paged_prefill_attention_ref` (softmax in the compute dtype's SDPA);
fp32 and bf16 caches, fp16 ones too (SDPA takes them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_prefill_attention_cpu(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences concatenated
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. the chunk
    scale: float,
    max_query_len: int | None = None,  # both unused: the lengths are read per sequence
    max_context_len: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    out = torch.empty_like(q)
    k_rows, v_rows = k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1)
    starts, ctx_lens = query_start_loc.tolist(), context_lens.tolist()
    tables = block_tables.long()
    for s, ctx in enumerate(ctx_lens):
        first, last = starts[s], starts[s + 1]
        q_len = last - first
        if q_len == 0:
            continue
        ids = tables[s, : -(-ctx // block_size)]
        k = k_rows.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:ctx]
        v = v_rows.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:ctx]
        mask = None
        if ctx > q_len:  # a chunk after cached tokens: query j sees keys 0 .. ctx - q_len + j
            keys = torch.arange(ctx)
            mask = keys[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
        attended = F.scaled_dot_product_attention(  # 4-D: a 3-D call takes the math path
            q[None, first:last].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2),
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
        )  # [1, num_heads, q_len, head_dim]
        out[first:last] = attended[0].transpose(0, 1)
    return out
