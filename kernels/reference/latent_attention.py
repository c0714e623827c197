"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, in plain torch.

The cache holds, per token, one entry of `kv_lora_rank + rope_dim` values: the normalized KV
latent, then the RoPE'd shared key. It is one "head" for the whole layer: every query head reads
the same entries, so a layer's cache is `[num_blocks, block_size, entry_dim]`, about 1/15 of a
per-head K/V cache of the same model (DeepSeek-V3: 576 values where GQA would hold 2 x 128 x 128).

A step reads it two ways (what vLLM's MLA backends and FlashMLA do):

- decode, absorbed: the query is taken into the latent space (its no-RoPE part times each head's
  key up-projection W_UK, then its RoPE part), so a score is one dot product with a cached entry
  and the output is a weighted sum of cached latents (`paged_latent_decode_attention_ref`); the
  caller takes it out of the latent space with each head's value up-projection W_UV. Nothing is
  decompressed per cached token.
- prefill, plain: the context's entries are gathered (`gather_latent_ref`), up-projected to each
  head's key and value by the layer's `kv_b_proj`, and attended causally
  (`prefill_attention_ref`), keys of `nope + rope` values and values of `v_head_dim`.

Slots past a sequence's length are never read here, so the cache need not be zero-filled for this
path's sake.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_latent_ref(
    entry: torch.Tensor,  # [num_tokens, entry_dim]: latent, then the RoPE'd key
    cache: torch.Tensor,  # [num_blocks, block_size, entry_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset
) -> None:
    num_blocks, block_size, dim = cache.shape
    cache.view(num_blocks * block_size, dim).index_copy_(0, slot_mapping, entry.to(cache.dtype))


def _slots(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
           ) -> torch.Tensor:  # [sum(context_lens)] int64: each sequence's slots, in order
    parts = []
    for table, length in zip(block_tables.tolist(), context_lens.tolist()):
        positions = torch.arange(length)
        blocks = torch.tensor(table, dtype=torch.int64)[positions // block_size]
        parts.append(blocks * block_size + positions % block_size)
    return torch.cat(parts).to(block_tables.device) if parts else \
        torch.empty(0, dtype=torch.int64, device=block_tables.device)


def gather_latent_ref(
    cache: torch.Tensor,  # [num_blocks, block_size, entry_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
) -> torch.Tensor:  # [sum(context_lens), entry_dim]: each sequence's entries, one after another
    num_blocks, block_size, dim = cache.shape
    flat = cache.view(num_blocks * block_size, dim)
    return flat.index_select(0, _slots(block_tables, context_lens, block_size))


def paged_latent_decode_attention_ref(
    q: torch.Tensor,  # [num_seqs, num_heads, entry_dim]: absorbed no-RoPE part, then RoPE part
    cache: torch.Tensor,  # [num_blocks, block_size, entry_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, incl. the new token
    scale: float,
    max_context_len: int,
    kv_lora_rank: int,  # the values are each entry's first kv_lora_rank numbers
) -> torch.Tensor:  # [num_seqs, num_heads, kv_lora_rank] in q's dtype
    """One query token per sequence against its whole context; softmax in fp32."""
    entries = gather_latent_ref(cache, block_tables, context_lens)
    out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank, dtype=q.dtype, device=q.device)
    start = 0
    for i, length in enumerate(context_lens.tolist()):
        ctx = entries[start:start + length].float()  # [S, entry_dim]
        start += length
        scores = (q[i].float() @ ctx.T) * scale  # [H, S]
        out[i] = (torch.softmax(scores, dim=-1) @ ctx[:, :kv_lora_rank]).to(q.dtype)
    return out


def prefill_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, qk_dim]
    k: torch.Tensor,  # [sum(context_lens), num_heads, qk_dim]
    v: torch.Tensor,  # [sum(context_lens), num_heads, v_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets into q
    context_lens: torch.Tensor,  # [num_seqs] int32, incl. the chunk; offsets into k/v by cumsum
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, v_dim]
    """Causal attention of each sequence's chunk (its last queries) over its context, the keys
    and values dense and per head, of different widths (MLA's plain prefill)."""
    out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    key_start = 0
    for i, length in enumerate(context_lens.tolist()):
        qs, qe = starts[i], starts[i + 1]
        n = qe - qs
        keys = slice(key_start, key_start + length)
        key_start += length
        # query j of the chunk sits at position length - n + j: it sees keys 0 .. that position
        mask = (torch.arange(length, device=q.device)[None, :]
                <= torch.arange(length - n, length, device=q.device)[:, None])
        out[qs:qe] = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k[keys].transpose(0, 1), v[keys].transpose(0, 1),
            attn_mask=mask, scale=scale).transpose(0, 1)
    return out
