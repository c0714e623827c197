"""The torch references (the CPU serving path) against naive float64 dense attention.

The dense oracle loops over sequences on the unpaged K/V the batch was built from, repeats
K/V for GQA and masks by index: nothing shared with the paged code. Unowned cache slots hold
large finite garbage, so a slot read with non-zero weight shows. Bounds (relative norm error):
fp32 1e-5, fp16 5e-3, bf16 2e-2 (SDPA in the cache dtype on CPU). The sliding window and the
soft cap are written here as Hugging Face writes them (Gemma 2's eager attention: cap, then
mask; the mask `kv_idx > q_idx - sliding_window` on the causal one, checked against
`transformers.masking_utils`); with a soft cap the reference computes in fp32 (same bounds).
"""

from __future__ import annotations

import pytest
import torch
from paged_case import make_case, rel_err

from pdserve.kernels.reference import paged_attention
from pdserve.kernels.reference.paged_attention import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)
from pdserve.kernels.reference.rms_norm import rms_norm_ref
from pdserve.kernels.reference.rotary_embedding import rotary_embedding_ref

BOUND = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def dense_attention(q, keys, values, scale, positions=None, sliding_window=None, soft_cap=None):
    """q [S, H, D] for decode (one query per sequence) or a list of [n_s, H, D] with the
    absolute `positions` of each query (causal prefill); keys/values [L_s, Hkv, D] each."""
    outs = []
    for s, (k, v) in enumerate(zip(keys, values, strict=True)):
        q_s = q[s].double() if positions is not None else q[s].double()[None]  # [n, H, D]
        group = q_s.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->nhl", q_s, k) * scale
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        q_idx = positions[s] if positions is not None else torch.tensor([k.shape[0] - 1])
        visible = torch.arange(k.shape[0])[None, :] <= q_idx[:, None]  # [n, L]
        if sliding_window is not None:
            visible &= torch.arange(k.shape[0])[None, :] > q_idx[:, None] - sliding_window
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        outs.append(torch.einsum("nhl,lhd->nhd", scores.softmax(-1), v))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,group,num_kv_heads", [(16, 1, 2), (32, 3, 3), (16, 8, 1)])
@pytest.mark.parametrize("chunk_bytes", [None, 1])  # 1: one sequence per chunk, sorted
def test_decode_reference_matches_dense(dtype, block_size, group, num_kv_heads, chunk_bytes,
                                        monkeypatch):
    if chunk_bytes is not None:
        monkeypatch.setattr(paged_attention, "CHUNK_BYTES", chunk_bytes)
    lens = [37, 1, 2000, 16, 300]
    case = make_case(lens, block_size, num_kv_heads, 64, dtype, seed=group, garbage=1e4)
    q = torch.randn(len(lens), group * num_kv_heads, 64).to(dtype)
    out = paged_decode_attention_ref(q, case.k_cache, case.v_cache, case.block_tables,
                                     case.context_lens, 0.125)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, dense_attention(q, case.keys, case.values, 0.125)) < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size,group,num_kv_heads", [(16, 1, 2), (32, 3, 1), (16, 8, 1)])
def test_prefill_reference_matches_dense(dtype, block_size, group, num_kv_heads):
    seqs = [(21, 2000), (1, 1), (37, 37), (20, 50)]  # (query_len, context_len)
    case = make_case([c for _, c in seqs], block_size, num_kv_heads, 64, dtype, seed=group,
                     garbage=1e4)
    num_heads = group * num_kv_heads
    qs = [torch.randn(n, num_heads, 64).to(dtype) for n, _ in seqs]
    positions = [torch.arange(c - n, c) for n, c in seqs]
    query_start_loc = torch.tensor([0, 21, 22, 59, 79], dtype=torch.int32)
    out = paged_prefill_attention_ref(torch.cat(qs), case.k_cache, case.v_cache,
                                      case.block_tables, query_start_loc, case.context_lens, 0.1)
    want = dense_attention(qs, case.keys, case.values, 0.1, positions)
    assert rel_err(out, want) < BOUND[dtype]


def test_dense_window_mask_is_hf_sliding_window_causal_mask():
    """The window rule of `dense_attention` is transformers' own mask function's."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    q_idx, kv_idx = torch.arange(40)[:, None], torch.arange(40)[None, :]
    for window in (1, 5, 16, 100):
        ours = (kv_idx <= q_idx) & (kv_idx > q_idx - window)
        assert torch.equal(ours, sliding_window_causal_mask_function(window)(0, 0, q_idx, kv_idx))


# (sliding_window, soft_cap): windows shorter than most contexts (not a multiple of the block
# size), of 1 key, longer than every context; a cap alone and with a window. The caps are
# small enough to change random scores (|s| ~ 1), Gemma 2's 50 would barely bite.
VARIANTS = [(1, None), (24, None), (5000, None), (None, 1.5), (37, 2.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window,soft_cap", VARIANTS)
@pytest.mark.parametrize("chunk_bytes", [None, 1])  # 1: one sequence per chunk, sorted
def test_decode_reference_window_and_soft_cap_match_dense(dtype, sliding_window, soft_cap,
                                                          chunk_bytes, monkeypatch):
    if chunk_bytes is not None:
        monkeypatch.setattr(paged_attention, "CHUNK_BYTES", chunk_bytes)
    lens = [37, 1, 300, 16, 24, 25]
    case = make_case(lens, 16, 2, 64, dtype, seed=3, garbage=1e4)
    q = torch.randn(len(lens), 6, 64).to(dtype)
    out = paged_decode_attention_ref(q, case.k_cache, case.v_cache, case.block_tables,
                                     case.context_lens, 0.125, sliding_window=sliding_window,
                                     soft_cap=soft_cap)
    want = dense_attention(q, case.keys, case.values, 0.125, sliding_window=sliding_window,
                           soft_cap=soft_cap)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, want) < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sliding_window,soft_cap", VARIANTS)
def test_prefill_reference_window_and_soft_cap_match_dense(dtype, sliding_window, soft_cap):
    # chunks that start mid-context (after 279 and 30 cached tokens), whole prompts, 1 token
    seqs = [(21, 300), (1, 1), (37, 37), (20, 50)]  # (query_len, context_len)
    case = make_case([c for _, c in seqs], 16, 1, 64, dtype, seed=4, garbage=1e4)
    qs = [torch.randn(n, 3, 64).to(dtype) for n, _ in seqs]
    positions = [torch.arange(c - n, c) for n, c in seqs]
    query_start_loc = torch.tensor([0, 21, 22, 59, 79], dtype=torch.int32)
    out = paged_prefill_attention_ref(torch.cat(qs), case.k_cache, case.v_cache,
                                      case.block_tables, query_start_loc, case.context_lens, 0.1,
                                      sliding_window=sliding_window, soft_cap=soft_cap)
    want = dense_attention(qs, case.keys, case.values, 0.1, positions, sliding_window, soft_cap)
    assert out.dtype == dtype and out.shape == torch.cat(qs).shape
    assert rel_err(out, want) < BOUND[dtype]


@pytest.mark.parametrize("bad", [{"sliding_window": 0}, {"sliding_window": 2.0},
                                 {"soft_cap": 0.0}, {"soft_cap": float("inf")}])
def test_references_reject_bad_variants(bad):
    case = make_case([5], 16, 1, 64, torch.float32)
    with pytest.raises(ValueError, match=next(iter(bad))):
        paged_decode_attention_ref(torch.randn(1, 1, 64), case.k_cache, case.v_cache,
                                   case.block_tables, case.context_lens, 0.125, **bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reference_is_hf_llama_rms_norm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    hf.weight.data.copy_(1 + 0.1 * torch.randn(576))
    x, residual = torch.randn(5, 576).to(dtype), torch.randn(5, 576).to(dtype)
    out, new_residual = rms_norm_ref(x, hf.weight.data, 1e-5, residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(out, hf(x + residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_reference_is_hf_apply_rotary_pos_emb(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    emb = torch.outer(torch.arange(512).float(), inv_freq).repeat(1, 2)
    cos, sin = emb.cos(), emb.sin()
    positions = torch.randint(0, 512, (7,))
    q, k = torch.randn(7, 9, 64).to(dtype), torch.randn(7, 3, 64).to(dtype)
    # HF: [batch, heads, seq, dim] with cos/sin [batch, seq, dim] cast to the model dtype.
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      cos[positions][None].to(dtype),
                                      sin[positions][None].to(dtype))
    rotary_embedding_ref(q, k, positions, cos, sin)
    assert torch.equal(q, hf_q[0].transpose(0, 1)) and torch.equal(k, hf_k[0].transpose(0, 1))
