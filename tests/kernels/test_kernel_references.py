"""The torch references (the CPU serving path) against naive float64 dense attention.

The dense oracle loops over sequences on the unpaged K/V the batch was built from, repeats
K/V for GQA and masks by index: nothing shared with the paged code. Unowned cache slots hold
large finite garbage, so a slot read with non-zero weight shows. Bounds (relative norm error):
fp32 1e-5, fp16 5e-3, bf16 2e-2 (SDPA in the cache dtype on CPU).
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


def dense_attention(q, keys, values, scale, positions=None):
    """q [S, H, D] for decode (one query per sequence) or a list of [n_s, H, D] with the
    absolute `positions` of each query (causal prefill); keys/values [L_s, Hkv, D] each."""
    outs = []
    for s, (k, v) in enumerate(zip(keys, values, strict=True)):
        q_s = q[s].double() if positions is not None else q[s].double()[None]  # [n, H, D]
        group = q_s.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->nhl", q_s, k) * scale
        if positions is not None:
            visible = torch.arange(k.shape[0])[None, :] <= positions[s][:, None]  # [n, L]
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
