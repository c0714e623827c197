"""The int8 KV format: its memory cost, and attention over it (Triton and torch paths).

Bounds: the Triton int8 kernels match the int8 torch references (same dequantized values,
fp32 math) to 1e-5 relative norm error; attention over int8 K/V matches attention over the
unquantized fp32 K/V to 2e-2 (a step of max|x|/127 per element; measured ~5e-3).
"""

from __future__ import annotations

import pytest
import torch
from paged_case import finite, make_case, quantize_case, rel_err

from pdserve.kernels.kv_quant import allocate_kv_cache, kv_cache_bytes_per_token
from pdserve.kernels.reference.paged_attention import (
    paged_decode_attention_int8_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_int8_ref,
    paged_prefill_attention_ref,
)
from pdserve.kernels.triton.paged_decode_attention import paged_decode_attention_int8
from pdserve.kernels.triton.paged_prefill_attention import paged_prefill_attention_int8
from pdserve.kernels.triton.store_kv import store_kv_int8


@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (8, 128)])
def test_int8_memory_per_token_about_half_of_fp16(num_kv_heads, head_dim):
    fp16 = kv_cache_bytes_per_token(num_kv_heads, head_dim, torch.float16)
    int8 = kv_cache_bytes_per_token(num_kv_heads, head_dim, torch.int8)
    assert fp16 == 2 * num_kv_heads * head_dim * 2
    assert int8 == 2 * num_kv_heads * (head_dim + 2)  # int8 values + one fp16 scale each
    # The values alone are exactly half; the per-token scales add 1/head_dim of fp16's cost.
    assert int8 / fp16 == pytest.approx(0.5 + 1 / head_dim)
    assert int8 / fp16 <= 0.516
    # What allocation really costs, per token of one layer.
    num_blocks, block_size = 5, 16
    for dtype, want in ((torch.float16, fp16), (torch.int8, int8)):
        tensors = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype,
                                    torch.device("cpu"))
        assert sum(t.nbytes for t in tensors) == want * num_blocks * block_size


@pytest.mark.parametrize("block_size,group,num_kv_heads", [(16, 3, 2), (32, 8, 1)])
def test_int8_decode_kernel_matches_references(block_size, group, num_kv_heads):
    lens = [1, 2000, 45]
    fp = make_case(lens, block_size, num_kv_heads, 64, torch.float32, seed=group)
    case = quantize_case(fp)  # NaN scales in unowned slots: a stray read poisons the output
    q = torch.randn(len(lens), group * num_kv_heads, 64)
    ref = paged_decode_attention_int8_ref(q, *_int8_args(finite(case)), 0.125)
    for num_splits in (1, 5):
        out = paged_decode_attention_int8(q, *_int8_args(case), 0.125, num_splits=num_splits)
        assert rel_err(out, ref) < 1e-5
    exact = paged_decode_attention_ref(q, *_fp_args(finite(fp)), 0.125)
    assert rel_err(ref, exact) < 2e-2


def test_int8_prefill_kernel_matches_references():
    seqs = [(1, 1), (20, 300), (9, 9)]
    fp = make_case([c for _, c in seqs], 16, 2, 64, torch.float32, seed=7)
    case = quantize_case(fp)
    q = torch.randn(30, 6, 64)
    qsl = torch.tensor([0, 1, 21, 30], dtype=torch.int32)
    c = finite(case)
    ref = paged_prefill_attention_int8_ref(q, c.k_cache, c.v_cache, c.k_scale, c.v_scale,
                                           c.block_tables, qsl, c.context_lens, 0.125)
    out = paged_prefill_attention_int8(q, case.k_cache, case.v_cache, case.k_scale,
                                       case.v_scale, case.block_tables, qsl,
                                       case.context_lens, 0.125)
    assert rel_err(out, ref) < 1e-5
    f = finite(fp)
    exact = paged_prefill_attention_ref(q, f.k_cache, f.v_cache, f.block_tables, qsl,
                                        f.context_lens, 0.125)
    assert rel_err(ref, exact) < 2e-2


def test_store_then_attend_int8_against_fp16():
    """The serving sequence on an fp16 model: quantizing store, then int8 decode."""
    torch.manual_seed(11)
    num_tokens, block_size, num_kv_heads, head_dim = 150, 16, 2, 64
    key = torch.randn(num_tokens, num_kv_heads, head_dim).half()
    value = torch.randn(num_tokens, num_kv_heads, head_dim).half()
    slots = torch.arange(num_tokens) + block_size  # block 0 stays unused
    cache = allocate_kv_cache(11, block_size, num_kv_heads, head_dim, torch.int8,
                              torch.device("cpu"))
    store_kv_int8(key, value, *cache, slots)
    tables = torch.arange(1, 11, dtype=torch.int32)[None]
    lens = torch.tensor([num_tokens], dtype=torch.int32)
    q = torch.randn(1, 4, head_dim).half()
    out = paged_decode_attention_int8(q, *cache, tables, lens, 0.125)
    k_fp = torch.zeros(11, block_size, num_kv_heads, head_dim)
    v_fp = torch.zeros_like(k_fp)
    k_fp.view(-1, num_kv_heads, head_dim)[slots] = key.float()
    v_fp.view(-1, num_kv_heads, head_dim)[slots] = value.float()
    exact = paged_decode_attention_ref(q.float(), k_fp, v_fp, tables, lens, 0.125)
    assert out.dtype == torch.float16
    assert rel_err(out, exact) < 2e-2


def _int8_args(case):
    return (case.k_cache, case.v_cache, case.k_scale, case.v_scale, case.block_tables,
            case.context_lens)


def _fp_args(case):
    return case.k_cache, case.v_cache, case.block_tables, case.context_lens
