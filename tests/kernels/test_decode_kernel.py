"""Triton paged decode attention against the torch reference (interpreter, small shapes).

Bounds (relative norm error against the reference evaluated in fp32 on the same inputs):
fp32 1e-5; fp16 2e-3; bf16 1e-2 (the interpreter truncates to bf16 instead of rounding).
With a sliding window the keys before each window hold NaN: the kernel must not read them.
"""

from __future__ import annotations

import pytest
import torch
from paged_case import finite, make_case, poison_before, quantize_case, rel_err

from pdserve.kernels.reference.paged_attention import (
    paged_decode_attention_int8_ref,
    paged_decode_attention_ref,
)
from pdserve.kernels.triton.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_int8,
)

BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (dtype, block_size, head_dim, group, num_kv_heads): every dtype meets every GQA ratio, both
# block sizes and both head dims; the full product would cost minutes in the interpreter.
CASES = [
    (torch.float32, 16, 64, 1, 2),
    (torch.float32, 32, 128, 3, 1),
    (torch.float32, 16, 128, 8, 1),
    (torch.float16, 32, 64, 8, 1),
    (torch.float16, 16, 128, 1, 2),
    (torch.float16, 16, 64, 3, 2),
    (torch.bfloat16, 32, 64, 1, 1),
    (torch.bfloat16, 16, 128, 3, 1),
    (torch.bfloat16, 32, 128, 8, 1),
]
# A 1-token and a 2000-token context in one batch, none a multiple of the block size but 16.
LENS = [1, 2000, 37, 16]


def _run(case, q, num_splits):
    return paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                  case.context_lens, 0.125, num_splits=num_splits)


def _ref(case, q, **variant):
    c = finite(case)
    return paged_decode_attention_ref(q.float(), c.k_cache.float(), c.v_cache.float(),
                                      c.block_tables, c.context_lens, 0.125, **variant)


@pytest.mark.parametrize("dtype,block_size,head_dim,group,num_kv_heads", CASES)
def test_decode_matches_reference(dtype, block_size, head_dim, group, num_kv_heads):
    case = make_case(LENS, block_size, num_kv_heads, head_dim, dtype, seed=block_size + group)
    q = torch.randn(len(LENS), num_kv_heads * group, head_dim).to(dtype)
    ref = _ref(case, q)
    # One program per sequence, and split-K with the merge kernel (7 splits of 320 tokens).
    for num_splits in (1, 7):
        out = _run(case, q, num_splits)
        assert out.dtype == dtype and out.shape == q.shape
        assert rel_err(out, ref) < BOUND[dtype], num_splits


# (dtype, block_size, sliding_window, soft_cap): windows of 1 key, shorter than the longest
# context and no multiple of the block size (or of BLOCK_N), longer than every context; caps
# small enough to change random scores.
VARIANT_CASES = [
    (torch.float32, 16, 40, 2.0),
    (torch.float32, 8, 1, None),
    (torch.bfloat16, 16, 1000, 1.5),
]
VARIANT_LENS = [1, 300, 37, 16]


@pytest.mark.parametrize("dtype,block_size,sliding_window,soft_cap", VARIANT_CASES)
def test_decode_window_and_soft_cap_match_reference(dtype, block_size, sliding_window,
                                                    soft_cap):
    case = make_case(VARIANT_LENS, block_size, 2, 64, dtype, seed=block_size)
    q = torch.randn(len(VARIANT_LENS), 6, 64).to(dtype)
    variant = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    ref = _ref(case, q, **variant)
    poisoned = poison_before(case, [max(0, n - sliding_window) for n in VARIANT_LENS])
    for num_splits in (1, 3):  # the splits share the window's keys
        out = paged_decode_attention(q, poisoned.k_cache, poisoned.v_cache, case.block_tables,
                                     case.context_lens, 0.125, num_splits=num_splits, **variant)
        assert rel_err(out, ref) < BOUND[dtype], num_splits


def test_decode_int8_window_and_soft_cap_match_reference():
    case = quantize_case(make_case([200, 7], 16, 1, 64, torch.float32, seed=6))
    q = torch.randn(2, 3, 64)
    args = (case.block_tables, case.context_lens, 0.125)
    variant = {"sliding_window": 50, "soft_cap": 2.0}
    c = finite(case)
    ref = paged_decode_attention_int8_ref(q, c.k_cache, c.v_cache, c.k_scale, c.v_scale, *args,
                                          **variant)
    p = poison_before(case, [150, 0])
    out = paged_decode_attention_int8(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, *args,
                                      num_splits=2, **variant)
    assert rel_err(out, ref) < 1e-5


def test_decode_head_dim_not_power_of_two():
    case = make_case([5, 130], 16, 2, 80, torch.float32, seed=3)
    q = torch.randn(2, 4, 80)
    assert rel_err(_run(case, q, 2), _ref(case, q)) < 1e-5


def test_decode_default_split_and_strided_query():
    case = make_case([300, 9], 16, 2, 64, torch.float32, seed=4)
    qkv = torch.randn(2, 8, 64)  # q is a view of a fused projection: row stride 8 * 64
    q = qkv[:, :4]
    out = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                 case.context_lens, 0.125, max_context_len=300)
    assert rel_err(out, _ref(case, q)) < 1e-5


def test_decode_rejects_bad_layout():
    case = make_case([5], 16, 2, 64, torch.float32)
    q = torch.randn(1, 3, 64)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        _run(case, q, 1)
    with pytest.raises(ValueError, match="k_cache"):
        paged_decode_attention(torch.randn(1, 2, 64), case.k_cache[0], case.v_cache[0],
                               case.block_tables, case.context_lens, 0.125)
