"""Paged attention in plain torch: the `torch` backend's, and the oracle of every kernel.

Torch cannot read K/V through a block table inside a matmul, so the blocks are copied out
(`index_select`) and handed to SDPA. What keeps that fast on a CPU:

- the copy goes through a 2-D view `[num_blocks, block_size * num_kv_heads * head_dim]`: one
  memcpy per block (an `index_select` on the 4-D cache is ~6x slower);
- decode copies in chunks of about `CHUNK_BYTES` into scratch reused across chunks (a fresh
  multi-MB tensor per chunk costs more in page faults than the copy), so SDPA reads the copy
  back from cache, not DRAM. Sequences are sorted by length and each chunk is padded only to
  its own longest. The loop runs once per `CHUNK_BYTES` of K/V: a batch of short contexts is
  one iteration, and only a context longer than a chunk gets one to itself;
- GQA by viewing the query heads that share a KV head as rows: K/V are never repeated.

What remains over dense SDPA is the copy's own DRAM read, of blocks scattered over the cache:
a 12 KB block (16 tokens of SmolLM2) read at a random place streams at about half the rate of
a sequential read, so larger blocks or allocation-ordered block tables narrow the gap
(`benchmarks/kernels.py` measures it).

Cache slots past a sequence's length are read with zero weight here (the Triton kernels never
read them), so they must hold finite values: allocate caches zero-filled.

Per-layer variants (keyword-only, None = off, as for Llama): `sliding_window` W lets a query at
position p see keys p - W < j <= p (Hugging Face's sliding-window causal mask, Mistral, Gemma 2
and 3's local layers); `soft_cap` c scores c * tanh(q.k * scale / c) before the mask and the
softmax (Gemma 2's `attn_logit_softcapping`). SDPA has no soft cap, so with one the scores are
computed in fp32 by hand; without, the path is SDPA as before. `sinks` (gpt-oss's attention
sinks: fp32 [num_heads], one learned logit per query head of the call) join each softmax's
denominator as one more logit, unscaled beside the scaled, capped and masked scores, with no
value: out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink - m)), m the max of both
(transformers' `eager_attention_forward` for GptOss); also by hand in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.checks import check_device, check_dtype, check_shape

# Gathered K+V per decode chunk: near one core's L2 (2 MiB on the dev machines), measured best.
CHUNK_BYTES = 3 << 20

Scales = tuple[torch.Tensor, torch.Tensor] | None  # (k_scale, v_scale) beside an int8 cache


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    scale: torch.Tensor | None,  # [num_blocks, block_size, num_kv_heads] for an int8 cache
    block_ids: torch.Tensor,  # [n] int64
    dtype: torch.dtype,
    out: torch.Tensor | None = None,  # flat scratch in dtype, >= n blocks
    raw: torch.Tensor | None = None,  # flat int8 scratch, >= n blocks (int8 caches)
) -> torch.Tensor:  # [n, block_size, num_kv_heads, head_dim] in dtype
    """Copy blocks out of the cache (dequantized for int8) into `out` when given.

    Scratch is reused across chunks on purpose: a fresh multi-MB tensor per chunk costs more
    in page faults than the copy itself.
    """
    num_blocks = cache.shape[0]
    n = block_ids.shape[0]
    shape = (n, *cache.shape[1:])
    numel = n * cache[0].numel() if num_blocks else 0
    if not cache.is_contiguous():
        rows = cache.index_select(0, block_ids)
    else:
        dst = raw if scale is not None else out
        if dst is not None and dst.dtype == cache.dtype:
            dst = dst[:numel].view(n, -1)
            rows = torch.index_select(cache.view(num_blocks, -1), 0, block_ids, out=dst)
        else:
            rows = cache.view(num_blocks, -1).index_select(0, block_ids)
        rows = rows.view(shape)
    if scale is None:
        return rows.to(dtype)
    s = scale.reshape(num_blocks, -1).index_select(0, block_ids)
    s = s.view(*shape[:3], 1).to(torch.float32)  # dequantize in fp32, as kv_quant does
    if out is None or dtype != torch.float32:
        return (rows * s).to(dtype)
    return torch.mul(rows, s, out=out[:numel].view(shape))


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    num_blocks_used: int,
    scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] (int8 cache)
    dtype: torch.dtype | None = None,  # default: the cache dtype (fp32 for int8)
) -> torch.Tensor:  # [num_seqs, num_kv_heads, num_blocks_used * block_size, head_dim]
    """Copy each sequence's blocks into one padded tensor (a transposed view of the copy)."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    num_seqs = block_tables.shape[0]
    if dtype is None:
        dtype = torch.float32 if cache.dtype == torch.int8 else cache.dtype
    table = block_tables[:, :num_blocks_used].reshape(-1).long()
    kv = gather_blocks(cache, scale, table, dtype)
    kv = kv.view(num_seqs, num_blocks_used * block_size, num_kv_heads, head_dim)
    return kv.transpose(1, 2)


def check_attention_variant(sliding_window: int | None, soft_cap: float | None) -> None:
    """ValueError unless each variant is off (None) or in range."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if soft_cap is not None and not (0.0 < soft_cap < float("inf")):
        raise ValueError(f"soft_cap must be None or a finite float > 0, got {soft_cap!r}")


def check_sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    """ValueError unless `sinks` is None or fp32 [num_heads] (the call's query heads), dense,
    on the query's device."""
    if sinks is None:
        return
    check_shape("sinks", sinks, (num_heads,))
    check_dtype("sinks", sinks, (torch.float32,))
    check_device(device, sinks=sinks)
    if sinks.stride(0) != 1:
        raise ValueError("sinks must be contiguous; pass sinks.contiguous()")


def attend(
    q: torch.Tensor,  # [..., num_queries, head_dim]
    k: torch.Tensor,  # [..., num_keys, head_dim]
    v: torch.Tensor,  # [..., num_keys, head_dim]
    mask: torch.Tensor | None,  # bool, broadcast to [..., num_queries, num_keys]
    scale: float,
    soft_cap: float | None,
    sinks: torch.Tensor | None = None,  # fp32, broadcast to [..., num_queries, 1]
) -> torch.Tensor:  # [..., num_queries, head_dim] in q's dtype
    """SDPA, or with a soft cap or sinks the same by hand: fp32 scores, capped, masked,
    softmax (each row's sink one more logit of its denominator)."""
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)
    top = torch.maximum(scores.amax(-1, keepdim=True), sinks)  # [..., num_queries, 1]
    weights = torch.exp(scores - top)
    weights = weights / (weights.sum(-1, keepdim=True) + torch.exp(sinks - top))
    return torch.matmul(weights, v.float()).to(q.dtype)


def compute_dtype(q: torch.Tensor, cache: torch.Tensor) -> torch.dtype:
    """Float caches compute in their own dtype; int8 caches dequantize to fp32."""
    return torch.float32 if cache.dtype == torch.int8 else cache.dtype


def _decode_chunks(lens: list[int], block_size: int, bytes_per_token: int) -> list[tuple]:
    """(first, last, num_blocks) per chunk of length-sorted (longest first) sequences."""
    chunks, first = [], 0
    while first < len(lens):
        num_blocks = -(-max(lens[first], 1) // block_size)
        per_seq = num_blocks * block_size * bytes_per_token
        last = min(len(lens), first + max(1, CHUNK_BYTES // per_seq))
        chunks.append((first, last, num_blocks))
        first = last
    return chunks


def _decode_mask(
    lens: torch.Tensor,  # [n] int64, longest first
    lens_list: list[int],  # the same
    padded_len: int,
    sliding_window: int | None,
) -> torch.Tensor | None:  # [n, 1, 1, padded_len] bool, or None: every key visible
    """Keys before each sequence's end and, with a window, within its last `sliding_window`."""
    cut = sliding_window is not None and lens_list[0] > sliding_window
    if lens_list[-1] >= padded_len and not cut:
        return None
    positions = torch.arange(padded_len, device=lens.device)
    mask = positions[None, :] < lens[:, None]
    if cut:
        mask &= positions[None, :] >= lens[:, None] - sliding_window
    return mask[:, None, None, :]


def decode_attention_torch(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    scales: Scales,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    check_attention_variant(sliding_window, soft_cap)
    num_seqs, num_heads, head_dim = q.shape
    check_sinks(sinks, num_heads, q.device)
    if num_seqs == 0:
        return torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    dtype = compute_dtype(q, k_cache)
    k_scale, v_scale = scales if scales is not None else (None, None)
    # Longest first: a chunk is padded to its first sequence's length only.
    lens, order = torch.sort(context_lens.long(), descending=True, stable=True)
    lens_list = lens.tolist()
    in_order = lens_list == context_lens.tolist()  # then `order` is the identity
    chunks = _decode_chunks(lens_list, block_size, 2 * k_cache[0, 0].numel() * dtype.itemsize)
    table = block_tables if in_order else block_tables.index_select(0, order)
    table = table[:, : chunks[0][2]].long()
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).to(dtype)
    row_sinks = None if sinks is None else sinks.view(num_kv_heads, -1, 1)  # qg's rows
    qg = qg if in_order else qg.index_select(0, order)
    out = torch.empty_like(qg)
    scratch_len = max((last - first) * nb for first, last, nb in chunks) * k_cache[0].numel()
    k_buf, v_buf = (torch.empty(scratch_len, dtype=dtype, device=q.device) for _ in range(2))
    raw = None if scales is None else torch.empty(scratch_len, dtype=k_cache.dtype, device=q.device)
    for first, last, num_blocks in chunks:
        ids = table[first:last, :num_blocks].reshape(-1)
        shape = (last - first, num_blocks * block_size, num_kv_heads, head_dim)
        k = gather_blocks(k_cache, k_scale, ids, dtype, k_buf, raw).view(shape)
        v = gather_blocks(v_cache, v_scale, ids, dtype, v_buf, raw).view(shape)
        mask = _decode_mask(lens[first:last], lens_list[first:last], shape[1], sliding_window)
        out[first:last] = attend(qg[first:last], k.transpose(1, 2), v.transpose(1, 2), mask,
                                 scale, soft_cap, row_sinks)
    if not in_order:
        out = torch.empty_like(out).index_copy_(0, order, out)
    return out.view(num_seqs, num_heads, head_dim).to(q.dtype)


def prefill_attention_torch(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences concatenated
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    scales: Scales,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, incl. the chunk
    scale: float,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    check_attention_variant(sliding_window, soft_cap)
    num_tokens, num_heads, head_dim = q.shape
    check_sinks(sinks, num_heads, q.device)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = context_lens.shape[0]
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    if max_query_len is None:
        max_query_len = int(query_lens.max())
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    device, dtype = q.device, compute_dtype(q, k_cache)
    k_scale, v_scale = scales if scales is not None else (None, None)

    # Scatter the ragged queries into a padded [S, max_q] grid.
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)
    row_of_token = torch.arange(num_tokens, device=device) - query_start_loc[seq_of_token].long()
    num_blocks = -(-max_context_len // block_size)
    k = gather_kv(k_cache, block_tables, num_blocks, k_scale, dtype)  # [S, Hkv, L, D]
    v = gather_kv(v_cache, block_tables, num_blocks, v_scale, dtype)
    qp = q.new_zeros(num_seqs, max_query_len, num_heads, head_dim, dtype=dtype)
    qp[seq_of_token, row_of_token] = q.to(dtype)
    # [S, Hkv, group * max_q, D]: the query heads sharing a KV head stacked as rows.
    qg = qp.view(num_seqs, max_query_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(num_seqs, num_kv_heads, group * max_query_len, head_dim)

    # Query row j of sequence s sits at absolute position context_len - query_len + j.
    q_pos = (context_lens.long() - query_lens)[:, None] + torch.arange(max_query_len, device=device)
    k_pos = torch.arange(k.shape[2], device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, max_q, L]; padded rows stay finite
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        padded = torch.arange(max_query_len, device=device)[None, :] >= query_lens[:, None]
        mask |= padded[:, :, None]  # a padded row past the window would see no key (NaN)
    mask = mask[:, None, None].expand(num_seqs, 1, group, max_query_len, k.shape[2])
    mask = mask.reshape(num_seqs, 1, group * max_query_len, k.shape[2])

    row_sinks = None  # [Hkv, group * max_q, 1]: each of qg's rows its head's sink
    if sinks is not None:
        row_sinks = sinks.view(num_kv_heads, group, 1).expand(-1, -1, max_query_len)
        row_sinks = row_sinks.reshape(num_kv_heads, group * max_query_len, 1)
    out = attend(qg, k, v, mask, scale, soft_cap, row_sinks)
    out = out.view(num_seqs, num_kv_heads, group, max_query_len, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_seqs, max_query_len, num_heads, head_dim)
    return out[seq_of_token, row_of_token].to(q.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. this one
    scale: float,
    max_context_len: int | None = None,
    *,
    sliding_window: int | None = None,  # keys p - W < j <= p only; None: all j <= p
    soft_cap: float | None = None,  # scores c * tanh(s / c); None: uncapped
    sinks: torch.Tensor | None = None,  # fp32 [num_heads]: a logit per head, no value
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    return decode_attention_torch(q, k_cache, v_cache, None, block_tables, context_lens, scale,
                                  sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)


def paged_decode_attention_int8_ref(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] int8
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] int8
    k_scale: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] fp16
    v_scale: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] fp16
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_context_len: int | None = None,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    return decode_attention_torch(
        q, k_cache, v_cache, (k_scale, v_scale), block_tables, context_lens, scale,
        sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
    )


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
    *,
    sliding_window: int | None = None,  # keys p - W < j <= p only; None: all j <= p
    soft_cap: float | None = None,  # scores c * tanh(s / c); None: uncapped
    sinks: torch.Tensor | None = None,  # fp32 [num_heads]: a logit per head, no value
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    return prefill_attention_torch(q, k_cache, v_cache, None, block_tables, query_start_loc,
                                   context_lens, scale, max_query_len, max_context_len,
                                   sliding_window=sliding_window, soft_cap=soft_cap,
                                   sinks=sinks)


def paged_prefill_attention_int8_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] int8
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] int8
    k_scale: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] fp16
    v_scale: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] fp16
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    return prefill_attention_torch(q, k_cache, v_cache, (k_scale, v_scale), block_tables,
                                   query_start_loc, context_lens, scale, max_query_len,
                                   max_context_len, sliding_window=sliding_window,
                                   soft_cap=soft_cap, sinks=sinks)
