"""Causal attention of a chunk of query tokens per sequence against its paged KV.

The chunk's own K/V are already stored in the cache, so cached prefix blocks (prefix-cache
hits, earlier chunks of a chunked prefill) and the new tokens are read the same way.

Triton: one program per (query tile, sequence, KV head). A tile's rows are `BLOCK_M // GROUP`
query tokens times the `GROUP` query heads of one KV head (GQA without repeating K/V); keys
are read through the block table `BLOCK_N` tokens at a time, up to the tile's last query
position (causal), with an online softmax in fp32.

Per-layer variants, constexpr flags as in the decode kernel: with a sliding window of W keys
(`WINDOW`) a tile's keys start at its first query's first visible one (p - W + 1: earlier blocks
are never read) and each row masks the keys before its own; a soft cap (`SOFT_CAP`) caps the
scores with the decode kernel's `cap_scores`; attention sinks (`SINKS`) start each row's
running max and sum at (its head's sink, 1): one more logit in the denominator, no value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import (
    FLOAT_DTYPES,
    check_block_tables,
    check_device,
    check_dtype,
    check_kv_cache,
    check_kv_scales,
    check_last_contiguous,
    check_shape,
)
from pdserve.kernels.reference.paged_attention import check_attention_variant, check_sinks
from pdserve.kernels.triton.launch import dot_dtype, dot_precision, new_output, pow2
from pdserve.kernels.triton.paged_decode_attention import cap_scores

LOG2E = 1.4426950408889634
BLOCK_M = 64  # rows (query tokens x heads of one KV head) per program
BLOCK_N = 64  # keys per inner step


@triton.jit
def _paged_prefill_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr, v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] (int8 caches only)
    block_tables_ptr,  # [num_seqs, max_blocks]
    query_start_loc_ptr,  # [num_seqs + 1]
    context_lens_ptr,  # [num_seqs]
    sinks_ptr,  # fp32 [num_heads] (SINKS only)
    qk_scale,
    window,  # WINDOW: keys visible to each query (its last `window`)
    cap,  # SOFT_CAP: the cap times log2(e); qk_scale is then scale / cap
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, SINKS: tl.constexpr,
):
    tile, seq, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tok0 = tile * BLOCK_Q
    if tok0 >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    r_mask = (r < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = context_len - q_len + tok  # absolute position of each row's query token
    d = tl.arange(0, DIM_PAD)
    d_mask = d < HEAD_DIM
    q_mask = r_mask[:, None] & d_mask[None, :]
    tok_row = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + tok_row[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask)
    q = q.to(tl.float32).to(DOT)
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:  # each row starts from its head's sink: the logit (log2 units), weight 1, no value
        m = tl.load(sinks_ptr + heads, mask=r_mask, other=0.0) * 1.4426950408889634
        m = tl.maximum(m, -1e30)  # a -inf sink (none) must not meet an all-masked block as NaN
        l_sum += 1.0
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    # Keys up to the tile's last query position; later ones are masked for every row.
    kv_end = context_len - q_len + tl.minimum(tok0 + BLOCK_Q, q_len)
    kv_start = 0
    if WINDOW:  # from the tile's first query's first visible key
        kv_start = tl.maximum(context_len - q_len + tok0 - window + 1, 0)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        block = tl.load(block_tables_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0)
        rows = block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(tl.float32).to(DOT)), input_precision=PRECISION)
        if QUANT:
            s_rows = block.to(tl.int64) * stride_sb + (n % BLOCK_SIZE) * stride_st
            s_rows += kv_head * stride_sh
            qk *= tl.load(k_scale_ptr + s_rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        if WINDOW:
            visible &= n[None, :] > q_pos[:, None] - window
        if SOFT_CAP:
            qk = tl.where(visible, cap_scores(qk * qk_scale, cap), float("-inf"))
        else:
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if QUANT:
            p *= tl.load(v_scale_ptr + s_rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        pv = tl.dot(p.to(DOT), v.to(tl.float32).to(DOT), input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    dst = out_ptr + tok_row[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check_prefill_args(q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                        quantized) -> None:
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache, quantized)
    check_shape("q", q, (None, None, head_dim))
    check_dtype("q", q, FLOAT_DTYPES)
    check_last_contiguous("q", q)
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads {q.shape[1]} must be a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    num_seqs = context_lens.shape[0]
    check_block_tables(block_tables, context_lens, num_seqs)
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    check_dtype("query_start_loc", query_start_loc, (torch.int32, torch.int64))
    check_device(q.device, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                 query_start_loc=query_start_loc, context_lens=context_lens)


def _launch(q, k_cache, v_cache, scales, block_tables, query_start_loc, context_lens, scale,
            max_query_len, sliding_window, cap, sinks) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = new_output(q.shape, q.dtype, q.device)
    num_seqs = context_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_m = max(BLOCK_M, pow2(group))
    k_scale, v_scale = scales if scales is not None else (k_cache, v_cache)
    scale_strides = k_scale.stride()[:3] if scales is not None else (0, 0, 0)
    dot = dot_dtype(k_cache.dtype, q.dtype)
    grid = (triton.cdiv(max_query_len, block_m // group), num_seqs, num_kv_heads)
    _paged_prefill_attention_kernel[grid](
        out, q, k_cache, v_cache, k_scale, v_scale, block_tables, query_start_loc,
        context_lens, q if sinks is None else sinks,  # never read without sinks
        scale * LOG2E if cap is None else scale / cap,
        sliding_window or 0, 0.0 if cap is None else cap * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *scale_strides,
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, DIM_PAD=pow2(head_dim, 16), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, QUANT=scales is not None, DOT=dot,
        PRECISION=dot_precision(dot), WINDOW=sliding_window is not None,
        SOFT_CAP=cap is not None, SINKS=sinks is not None,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences concatenated
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. the chunk
    scale: float,
    max_query_len: int | None = None,  # >= every query length; None: read it (a GPU sync)
    max_context_len: int | None = None,  # unused: the kernel reads lengths on the device
    *,
    sliding_window: int | None = None,  # keys p - W < j <= p only; None: all j <= p
    soft_cap: float | None = None,  # scores c * tanh(s / c); None: uncapped
    sinks: torch.Tensor | None = None,  # fp32 [num_heads]: a logit per head, no value
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    _check_prefill_args(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, False)
    check_attention_variant(sliding_window, soft_cap)
    check_sinks(sinks, q.shape[1], q.device)
    return _launch(q, k_cache, v_cache, None, block_tables, query_start_loc, context_lens,
                   scale, max_query_len, sliding_window, soft_cap, sinks)


def paged_prefill_attention_int8(
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
    _check_prefill_args(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, True)
    check_kv_scales(k_scale, v_scale, k_cache)
    check_attention_variant(sliding_window, soft_cap)
    check_sinks(sinks, q.shape[1], q.device)
    return _launch(q, k_cache, v_cache, (k_scale, v_scale), block_tables, query_start_loc,
                   context_lens, scale, max_query_len, sliding_window, soft_cap, sinks)


