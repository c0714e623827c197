"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged latent cache, in Triton.

The four ops of `kernels.reference.latent_attention`, with its signatures (read its module doc
for the cache: `[num_blocks, block_size, entry_dim]`, an entry = `kv_lora_rank` latent values,
then `rope_dim` RoPE'd key values):

- `store_latent`: one program per new token copies its entry to its slot (negative slots,
  padding tokens, are skipped, as `store_kv` does; the reference expects every slot valid).
- `gather_latent`: one program per (sequence, tile of tokens) copies entries through the block
  table into one dense `[sum(context_lens), entry_dim]` tensor (what the prefill expands).
- `paged_latent_decode_attention`: absorbed decode. One program per (sequence, block of
  `BLOCK_H` query heads, split of the context): a tile of `BLOCK_N` entries is loaded once and
  serves every head of the block twice, the latent part as keys (with the RoPE part beside it:
  two dots, so neither width is padded to the other's power of two) and as values. That is
  MLA's point: one cached entry per token for all heads, read once per head block. Long contexts
  are split (flash-decoding) and merged by `paged_decode_attention`'s merge kernel.
- `prefill_attention`: dense varlen causal flash attention, keys and values per head, of
  different widths (qk = nope + rope, e.g. 192; v e.g. 128). One program per (query tile,
  sequence, head); a sequence's queries are the last `q_len` of its `context_len` positions and
  its keys start at the cumulative sum of the earlier context lengths. A qk width that is no
  power of two is split into a power of two and a rest (192 = 128 + 64), two dots again.

Softmax is online in fp32, base 2; the dots take the cache's half type on a GPU (fp32 with IEEE
precision for fp32) and fp32 under the interpreter (`launch.dot_dtype`).

Why one file: the four ops are one concept (the reference's module, op for op) and they
share the cache's layout and checks.
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
    check_last_contiguous,
    check_latent_cache,
    check_latent_decode,
    check_shape,
)
from pdserve.kernels.triton.launch import (
    dot_dtype,
    dot_precision,
    new_output,
    num_programs_target,
    pow2,
)
from pdserve.kernels.triton.paged_decode_attention import (
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    _paged_decode_merge_kernel,
)

LOG2E = 1.4426950408889634
BLOCK_H = 16  # query heads per decode program (tl.dot's minimum M)
GATHER_TOKENS = 16  # entries per gather program
PREFILL_M = 64  # query tokens per prefill program
PREFILL_N = 32  # keys per prefill inner step
# Warps per decode / prefill program: at DeepSeek-V3's widths (rank 512; qk 192, v 128) 4 warps
# spill registers on sm_90 (ptxas -v), 8 do not, in every dtype.
NUM_WARPS = 8


@triton.jit
def _store_latent_kernel(
    entry_ptr,  # [num_tokens, entry_dim]
    cache_ptr,  # [num_blocks, block_size, entry_dim]
    slot_mapping_ptr,  # [num_tokens]
    stride_et, stride_cb, stride_ct,
    ENTRY_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    d = tl.arange(0, DIM_PAD)
    mask = d < ENTRY_DIM
    x = tl.load(entry_ptr + token.to(tl.int64) * stride_et + d, mask=mask)
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + d
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_latent_kernel(
    out_ptr,  # [sum(context_lens), entry_dim]
    cache_ptr,  # [num_blocks, block_size, entry_dim]
    block_tables_ptr,  # [num_seqs, max_blocks]
    context_lens_ptr,  # [num_seqs]
    out_start_ptr,  # [num_seqs] int64: each sequence's first row of out
    stride_ot, stride_cb, stride_ct, stride_bt,
    ENTRY_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    seq, tile = tl.program_id(0), tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    if tile * BLOCK_T >= context_len:
        return
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < context_len
    block = tl.load(block_tables_ptr + seq * stride_bt + t // BLOCK_SIZE, mask=t_mask, other=0)
    src = block.to(tl.int64) * stride_cb + (t % BLOCK_SIZE) * stride_ct
    dst = (tl.load(out_start_ptr + seq) + t).to(tl.int64) * stride_ot
    d = tl.arange(0, DIM_PAD)
    mask = t_mask[:, None] & (d[None, :] < ENTRY_DIM)
    x = tl.load(cache_ptr + src[:, None] + d[None, :], mask=mask)
    tl.store(out_ptr + dst[:, None] + d[None, :], x, mask=mask)


@triton.jit
def _paged_latent_decode_kernel(
    out_ptr,  # [num_seqs, num_heads, rank], or fp32 [num_seqs, num_heads, splits, rank]
    m_ptr, l_ptr,  # fp32 [num_seqs, num_heads, splits]: running max (log2) and sum per split
    q_ptr,  # [num_seqs, num_heads, entry_dim]: absorbed no-RoPE part, then RoPE part
    cache_ptr,  # [num_blocks, block_size, entry_dim]
    block_tables_ptr,  # [num_seqs, max_blocks]
    context_lens_ptr,  # [num_seqs]
    qk_scale, tokens_per_split, num_heads,
    stride_qs, stride_qh, stride_os, stride_oh, stride_cb, stride_ct, stride_bt,
    RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    seq, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(context_len, start + tokens_per_split)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    r = tl.arange(0, RANK_PAD)
    e = tl.arange(0, ROPE_PAD)
    q_rows = q_ptr + seq * stride_qs + heads[:, None] * stride_qh
    q_mask = h_mask[:, None] & (r[None, :] < RANK)
    q_lat = tl.load(q_rows + r[None, :], mask=q_mask, other=0.0).to(tl.float32).to(DOT)
    if ROPE > 0:
        pe_mask = h_mask[:, None] & (e[None, :] < ROPE)
        q_pe = tl.load(q_rows + RANK + e[None, :], mask=pe_mask, other=0.0)
        q_pe = q_pe.to(tl.float32).to(DOT)
    m = tl.full([BLOCK_H], -1e30, tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block = tl.load(block_tables_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0)
        rows = cache_ptr + block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_ct
        lat_mask = n_mask[:, None] & (r[None, :] < RANK)
        lat = tl.load(rows[:, None] + r[None, :], mask=lat_mask, other=0.0)
        lat = lat.to(tl.float32).to(DOT)  # the keys' latent part, and the values
        qk = tl.dot(q_lat, tl.trans(lat), input_precision=PRECISION)
        if ROPE > 0:
            pe = tl.load(rows[:, None] + RANK + e[None, :],
                         mask=n_mask[:, None] & (e[None, :] < ROPE), other=0.0)
            qk += tl.dot(q_pe, tl.trans(pe.to(tl.float32).to(DOT)), input_precision=PRECISION)
        qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), lat, input_precision=PRECISION)
        m = m_new
    if SPLIT:
        # Unnormalised partials; the merge kernel weighs them by exp2(m - max m).
        row = (seq * num_heads + heads) * tl.num_programs(2) + split
        tl.store(out_ptr + row[:, None] * RANK + r[None, :], acc, mask=q_mask)
        tl.store(m_ptr + row, m, mask=h_mask)
        tl.store(l_ptr + row, l_sum, mask=h_mask)
    else:
        out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
        dst = out_ptr + seq * stride_os + heads[:, None] * stride_oh + r[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _prefill_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, v_dim]
    q_ptr,  # [num_tokens, num_heads, qk_dim]
    k_ptr,  # [sum(context_lens), num_heads, qk_dim]
    v_ptr,  # [sum(context_lens), num_heads, v_dim]
    query_start_loc_ptr,  # [num_seqs + 1]
    context_lens_ptr,  # [num_seqs]
    key_start_ptr,  # [num_seqs] int64: each sequence's first row of k / v
    qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    QK_DIM: tl.constexpr, QK_A: tl.constexpr, QK_B_PAD: tl.constexpr, V_DIM: tl.constexpr,
    V_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tok0 = tile * BLOCK_M
    if tok0 >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    key_start = tl.load(key_start_ptr + seq)
    tok = tok0 + tl.arange(0, BLOCK_M)
    t_mask = tok < q_len
    q_pos = context_len - q_len + tok  # absolute position of each row's query
    a = tl.arange(0, QK_A)  # the qk dims' power-of-two part (then the rest, QK_B_PAD wide)
    dv = tl.arange(0, V_PAD)
    q_rows = q_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_qt + head * stride_qh
    q_a = tl.load(q_rows + a[None, :], mask=t_mask[:, None] & (a[None, :] < QK_DIM), other=0.0)
    q_a = q_a.to(tl.float32).to(DOT)
    if QK_B_PAD > 0:
        b = QK_A + tl.arange(0, QK_B_PAD)
        q_b = tl.load(q_rows + b[None, :], mask=t_mask[:, None] & (b[None, :] < QK_DIM),
                      other=0.0)
        q_b = q_b.to(tl.float32).to(DOT)
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_PAD], tl.float32)
    kv_end = context_len - q_len + tl.minimum(tok0 + BLOCK_M, q_len)  # the tile's last key + 1
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        key = (key_start + n).to(tl.int64)
        k_rows = k_ptr + key[:, None] * stride_kt + head * stride_kh
        k_a = tl.load(k_rows + a[None, :], mask=n_mask[:, None] & (a[None, :] < QK_DIM),
                      other=0.0)
        qk = tl.dot(q_a, tl.trans(k_a.to(tl.float32).to(DOT)), input_precision=PRECISION)
        if QK_B_PAD > 0:
            k_b = tl.load(k_rows + b[None, :], mask=n_mask[:, None] & (b[None, :] < QK_DIM),
                          other=0.0)
            qk += tl.dot(q_b, tl.trans(k_b.to(tl.float32).to(DOT)), input_precision=PRECISION)
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + key[:, None] * stride_vt + head * stride_vh + dv[None, :],
                    mask=n_mask[:, None] & (dv[None, :] < V_DIM), other=0.0)
        pv = tl.dot(p.to(DOT), v.to(tl.float32).to(DOT), input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    dst = out_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_ot + head * stride_oh
    tl.store(dst + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=t_mask[:, None] & (dv[None, :] < V_DIM))


def store_latent(
    entry: torch.Tensor,  # [num_tokens, entry_dim]: latent, then the RoPE'd key
    cache: torch.Tensor,  # [num_blocks, block_size, entry_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset
) -> None:
    entry_dim = check_latent_cache(cache)
    check_shape("entry", entry, (None, entry_dim))
    check_dtype("entry", entry, FLOAT_DTYPES)
    check_last_contiguous("entry", entry)
    check_shape("slot_mapping", slot_mapping, (entry.shape[0],))
    check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    check_device(cache.device, entry=entry, slot_mapping=slot_mapping)
    if entry.shape[0] == 0:
        return
    _store_latent_kernel[(entry.shape[0],)](
        entry, cache, slot_mapping, entry.stride(0), cache.stride(0), cache.stride(1),
        ENTRY_DIM=entry_dim, DIM_PAD=pow2(entry_dim), BLOCK_SIZE=cache.shape[1],
    )


def gather_latent(
    cache: torch.Tensor,  # [num_blocks, block_size, entry_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
) -> torch.Tensor:  # [sum(context_lens), entry_dim]: each sequence's entries, one after another
    entry_dim = check_latent_cache(cache)
    num_seqs = context_lens.shape[0]
    check_block_tables(block_tables, context_lens, num_seqs)
    check_device(cache.device, block_tables=block_tables, context_lens=context_lens)
    ends = context_lens.to(torch.int64).cumsum(0)
    total = int(ends[-1]) if num_seqs else 0  # the output's size: one sync, as the reference
    out = new_output((total, entry_dim), cache.dtype, cache.device)
    if total == 0:
        return out
    block_size = cache.shape[1]
    # every context fits its table: the grid covers the longest without reading the lengths
    grid = (num_seqs, triton.cdiv(block_tables.shape[1] * block_size, GATHER_TOKENS))
    _gather_latent_kernel[grid](
        out, cache, block_tables, context_lens, ends - context_lens, out.stride(0),
        cache.stride(0), cache.stride(1), block_tables.stride(0),
        ENTRY_DIM=entry_dim, DIM_PAD=pow2(entry_dim), BLOCK_SIZE=block_size,
        BLOCK_T=GATHER_TOKENS,
    )
    return out


def _decode_splits(num_seqs: int, head_blocks: int, max_context_len: int, block_n: int,
                   num_splits: int | None, device: torch.device) -> tuple[int, int]:
    """(num_splits, tokens_per_split): enough programs to fill the GPU, splits no shorter than
    MIN_TOKENS_PER_SPLIT (unless asked), each a multiple of the kernel's step."""
    context = max(max_context_len, 1)
    if num_splits is None:
        wanted = -(-num_programs_target(device) // (num_seqs * head_blocks))
        num_splits = min(wanted, -(-context // MIN_TOKENS_PER_SPLIT), MAX_SPLITS)
    per_split = -(-context // max(1, num_splits))
    per_split = -(-per_split // block_n) * block_n
    return -(-context // per_split), per_split


def paged_latent_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, entry_dim]: absorbed no-RoPE part, then RoPE part
    cache: torch.Tensor,  # [num_blocks, block_size, entry_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, incl. the new token
    scale: float,
    max_context_len: int,  # >= every context_len (sizes the splits without a GPU sync)
    kv_lora_rank: int,  # the values are each entry's first kv_lora_rank numbers
    *,
    num_splits: int | None = None,  # None: enough to fill the GPU
) -> torch.Tensor:  # [num_seqs, num_heads, kv_lora_rank] in q's dtype
    check_latent_decode(q, cache, block_tables, context_lens, kv_lora_rank)
    num_seqs, num_heads, entry_dim = q.shape
    out = new_output((num_seqs, num_heads, kv_lora_rank), q.dtype, q.device)
    if num_seqs == 0 or num_heads == 0:
        return out
    rank, rope = kv_lora_rank, entry_dim - kv_lora_rank
    block_n = 32 if rank > 256 else 64  # the entry tile and the fp32 accumulator share smem/regs
    head_blocks = triton.cdiv(num_heads, BLOCK_H)
    num_splits, per_split = _decode_splits(num_seqs, head_blocks, max_context_len, block_n,
                                           num_splits, q.device)
    split = num_splits > 1
    if split:
        acc = new_output((num_seqs, num_heads, num_splits, rank), torch.float32, q.device)
        m = new_output((num_seqs, num_heads, num_splits), torch.float32, q.device)
        l_sum = new_output((num_seqs, num_heads, num_splits), torch.float32, q.device)
    else:
        acc, m, l_sum = out, out, out  # m / l_sum unused without splits
    dot = dot_dtype(cache.dtype, q.dtype)
    _paged_latent_decode_kernel[(num_seqs, head_blocks, num_splits)](
        acc, m, l_sum, q, cache, block_tables, context_lens, scale * LOG2E, per_split,
        num_heads, q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0),
        cache.stride(1), block_tables.stride(0),
        RANK=rank, RANK_PAD=pow2(rank, 16), ROPE=rope, ROPE_PAD=pow2(rope, 16),
        BLOCK_H=BLOCK_H, BLOCK_SIZE=cache.shape[1], BLOCK_N=block_n, SPLIT=split, DOT=dot,
        PRECISION=dot_precision(dot), num_warps=NUM_WARPS,
    )
    if split:
        _paged_decode_merge_kernel[(num_seqs, num_heads)](
            out, acc, m, l_sum, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=rank, DIM_PAD=pow2(rank, 16), SPLITS_PAD=pow2(num_splits),
        )
    return out


def qk_split(qk_dim: int) -> tuple[int, int]:
    """(QK_A, QK_B_PAD): the qk width as a power of two (>= 16) and the rest, padded (0: none)."""
    a = max(16, 1 << (qk_dim.bit_length() - 1))
    return a, pow2(qk_dim - a, 16) if qk_dim > a else 0


def _check_prefill_args(q, k, v, query_start_loc, context_lens) -> None:
    check_shape("k", k, (None, q.shape[1], q.shape[2]))
    check_shape("v", v, (k.shape[0], q.shape[1], None))
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, t, FLOAT_DTYPES)
        check_last_contiguous(name, t)
    num_seqs = context_lens.shape[0]
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    check_dtype("query_start_loc", query_start_loc, (torch.int32, torch.int64))
    check_dtype("context_lens", context_lens, (torch.int32, torch.int64))
    check_device(q.device, k=k, v=v, query_start_loc=query_start_loc,
                 context_lens=context_lens)


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, qk_dim]
    k: torch.Tensor,  # [sum(context_lens), num_heads, qk_dim]
    v: torch.Tensor,  # [sum(context_lens), num_heads, v_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets into q
    context_lens: torch.Tensor,  # [num_seqs] int32, incl. the chunk; offsets into k/v by cumsum
    scale: float,
    *,
    max_query_len: int | None = None,  # >= every query length; None: read it (a GPU sync)
) -> torch.Tensor:  # [num_tokens, num_heads, v_dim]
    _check_prefill_args(q, k, v, query_start_loc, context_lens)
    num_tokens, num_heads, qk_dim = q.shape
    v_dim = v.shape[2]
    out = new_output((num_tokens, num_heads, v_dim), q.dtype, q.device)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int(query_start_loc.diff().max())
    key_start = context_lens.to(torch.int64).cumsum(0) - context_lens
    qk_a, qk_b_pad = qk_split(qk_dim)
    dot = dot_dtype(k.dtype, q.dtype)
    _prefill_attention_kernel[(triton.cdiv(max_query_len, PREFILL_M), num_seqs, num_heads)](
        out, q, k, v, query_start_loc, context_lens, key_start, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        QK_DIM=qk_dim, QK_A=qk_a, QK_B_PAD=qk_b_pad, V_DIM=v_dim, V_PAD=pow2(v_dim, 16),
        BLOCK_M=PREFILL_M, BLOCK_N=PREFILL_N, DOT=dot, PRECISION=dot_precision(dot),
        num_warps=NUM_WARPS,
    )
    return out
