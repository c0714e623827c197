"""Attention of one query token per sequence against that sequence's paged KV.

Triton: one program per (sequence, KV head, split). The query heads that share a KV head are
the rows of one tile (GQA without repeating K/V), keys are read token by token through the
block table (`BLOCK_N` tokens per step, any cache block size), softmax is online in fp32.
Long contexts are split over several programs (flash-decoding); a second kernel merges the
splits by their log-sum-exp. int8 caches apply the per-token scales to the scores (K) and to
the probabilities (V), so the int8 values go to the dot unchanged.

Per-layer variants, each a constexpr flag (off: the kernel is the one without them): a sliding
window of W keys (`WINDOW`) moves the range the splits share to the last W keys, so keys and
blocks before it are never read and the splits are sized for W; a soft cap c (`SOFT_CAP`)
scores c * tanh(s / c) (`cap_scores`, shared with the prefill kernel); attention sinks
(`SINKS`, gpt-oss: one logit per query head in the softmax's denominator, with no value) start
split 0's running max and sum at (sink, 1), so the merge kernel weighs them in unchanged.
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
from pdserve.kernels.triton.launch import (
    dot_dtype,
    dot_precision,
    new_output,
    num_programs_target,
    pow2,
)

LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per inner step
MIN_TOKENS_PER_SPLIT = 256  # below this a split costs more in the merge than it saves
MAX_SPLITS = 32  # bounds the merge kernel's tile


@triton.jit
def cap_scores(qk, cap):
    """cap * tanh(qk) (qk already divided by cap): (1 - e) / (1 + e), e = exp(-2|qk|), which
    neither overflows nor loses more than ~1e-7 of tanh anywhere (no tanh in tl)."""
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(qk))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(qk < 0.0, -t, t)


@triton.jit
def _paged_decode_attention_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim], or fp32 [num_seqs, num_heads, splits, head_dim]
    m_ptr, l_ptr,  # fp32 [num_seqs, num_heads, splits]: running max (log2) and sum per split
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr, v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] (int8 caches only)
    block_tables_ptr,  # [num_seqs, max_blocks]
    context_lens_ptr,  # [num_seqs]
    sinks_ptr,  # fp32 [num_heads] (SINKS only)
    qk_scale, tokens_per_split,
    window,  # WINDOW: keys visible to the query (the last `window`)
    cap,  # SOFT_CAP: the cap times log2(e); qk_scale is then scale / cap
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, SINKS: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    if WINDOW:  # the splits share the window's keys: none before it is read
        start = tl.maximum(context_len - window, 0) + split * tokens_per_split
    else:
        start = split * tokens_per_split
    end = tl.minimum(context_len, start + tokens_per_split)
    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    d = tl.arange(0, DIM_PAD)
    d_mask = d < HEAD_DIM
    q_mask = (g[:, None] < GROUP) & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=q_mask)
    q = q.to(tl.float32).to(DOT)
    m = tl.full([GROUP_PAD], -1e30, tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    if SINKS:  # split 0 starts from the sink: its logit (in log2 units) with weight 1, no value
        sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=0.0) * 1.4426950408889634
        m = tl.where(split == 0, tl.maximum(sink, -1e30), m)  # a -inf sink: none
        l_sum = tl.where(split == 0, 1.0, l_sum)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block = tl.load(block_tables_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0)
        rows = block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(tl.float32).to(DOT)), input_precision=PRECISION)
        if QUANT:
            s_rows = block.to(tl.int64) * stride_sb + (n % BLOCK_SIZE) * stride_st
            s_rows += kv_head * stride_sh
            qk *= tl.load(k_scale_ptr + s_rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if SOFT_CAP:
            qk = tl.where(n_mask[None, :], cap_scores(qk * qk_scale, cap), float("-inf"))
        else:
            qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))
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
    if SPLIT:
        # Unnormalised partials; the merge kernel weighs them by exp2(m - max m).
        row = (seq * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2) + split
        tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
        tl.store(m_ptr + row, m, mask=g < GROUP)
        tl.store(l_ptr + row, l_sum, mask=g < GROUP)
    else:
        out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
        dst = out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _paged_decode_merge_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    acc_ptr,  # fp32 [num_seqs, num_heads, num_splits, head_dim]
    m_ptr, l_ptr,  # fp32 [num_seqs, num_heads, num_splits]
    num_splits, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_mask = s < num_splits
    d = tl.arange(0, DIM_PAD)
    row = (seq * tl.num_programs(1) + head) * num_splits + s
    m = tl.load(m_ptr + row, mask=s_mask, other=float("-inf"))
    l_sum = tl.load(l_ptr + row, mask=s_mask, other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))  # empty splits carry l_sum 0
    mask = s_mask[:, None] & (d[None, :] < HEAD_DIM)
    acc = tl.load(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    total = tl.sum(weight * l_sum, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    dst = out_ptr + seq * stride_os + head * stride_oh + d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device) -> int:
    """Enough programs to fill the GPU, never splits shorter than MIN_TOKENS_PER_SPLIT."""
    wanted = -(-num_programs_target(device) // (num_seqs * num_kv_heads))
    return max(1, min(wanted, -(-max_context_len // MIN_TOKENS_PER_SPLIT), MAX_SPLITS))


def _check_decode_args(q, k_cache, v_cache, block_tables, context_lens, quantized) -> None:
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache, quantized)
    check_shape("q", q, (None, None, head_dim))
    check_dtype("q", q, FLOAT_DTYPES)
    check_last_contiguous("q", q)
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads {q.shape[1]} must be a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    check_block_tables(block_tables, context_lens, q.shape[0])
    check_device(q.device, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                 context_lens=context_lens)


def _launch(q, k_cache, v_cache, scales, block_tables, context_lens, scale, max_context_len,
            num_splits, sliding_window, cap, sinks) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = new_output(q.shape, q.dtype, q.device)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    if sliding_window is not None:  # what the splits share: at most the window's keys
        max_context_len = min(max_context_len, sliding_window)
    if num_splits is None:
        num_splits = _num_splits(num_seqs, num_kv_heads, max_context_len, q.device)
    num_splits = max(1, num_splits)
    tokens_per_split = -(-max(max_context_len, 1) // num_splits)
    tokens_per_split = -(-tokens_per_split // BLOCK_N) * BLOCK_N
    num_splits = -(-max(max_context_len, 1) // tokens_per_split)
    split = num_splits > 1
    if split:
        acc = new_output((num_seqs, num_heads, num_splits, head_dim), torch.float32, q.device)
        m = new_output((num_seqs, num_heads, num_splits), torch.float32, q.device)
        l_sum = new_output((num_seqs, num_heads, num_splits), torch.float32, q.device)
    else:
        acc, m, l_sum = out, out, out  # m / l_sum unused without splits
    k_scale, v_scale = scales if scales is not None else (k_cache, v_cache)
    scale_strides = k_scale.stride()[:3] if scales is not None else (0, 0, 0)
    dot = dot_dtype(k_cache.dtype, q.dtype)
    _paged_decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        acc, m, l_sum, q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
        q if sinks is None else sinks,  # never read without sinks
        scale * LOG2E if cap is None else scale / cap, tokens_per_split,
        sliding_window or 0, 0.0 if cap is None else cap * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *scale_strides,
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, GROUP_PAD=pow2(num_heads // num_kv_heads, 16),
        HEAD_DIM=head_dim, DIM_PAD=pow2(head_dim, 16), BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        QUANT=scales is not None, SPLIT=split, DOT=dot, PRECISION=dot_precision(dot),
        WINDOW=sliding_window is not None, SOFT_CAP=cap is not None, SINKS=sinks is not None,
    )
    if split:
        _paged_decode_merge_kernel[(num_seqs, num_heads)](
            out, acc, m, l_sum, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, DIM_PAD=pow2(head_dim, 16), SPLITS_PAD=pow2(num_splits),
        )
    return out


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. this one
    scale: float,
    max_context_len: int | None = None,  # >= every context_len; None: read it (a GPU sync)
    *,
    num_splits: int | None = None,  # None: enough to fill the GPU
    sliding_window: int | None = None,  # keys p - W < j <= p only; None: all j <= p
    soft_cap: float | None = None,  # scores c * tanh(s / c); None: uncapped
    sinks: torch.Tensor | None = None,  # fp32 [num_heads]: a logit per head, no value
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    _check_decode_args(q, k_cache, v_cache, block_tables, context_lens, quantized=False)
    check_attention_variant(sliding_window, soft_cap)
    check_sinks(sinks, q.shape[1], q.device)
    return _launch(q, k_cache, v_cache, None, block_tables, context_lens, scale,
                   max_context_len, num_splits, sliding_window, soft_cap, sinks)


def paged_decode_attention_int8(
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
    num_splits: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    _check_decode_args(q, k_cache, v_cache, block_tables, context_lens, quantized=True)
    check_kv_scales(k_scale, v_scale, k_cache)
    check_attention_variant(sliding_window, soft_cap)
    check_sinks(sinks, q.shape[1], q.device)
    return _launch(q, k_cache, v_cache, (k_scale, v_scale), block_tables, context_lens, scale,
                   max_context_len, num_splits, sliding_window, soft_cap, sinks)


