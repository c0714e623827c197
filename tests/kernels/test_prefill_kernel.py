"""Triton paged prefill attention against the torch reference (interpreter, small shapes).

Bounds as for decode (relative norm error against the fp32 reference on the same inputs):
fp32 1e-5; fp16 2e-3; bf16 1e-2 (the interpreter truncates to bf16 instead of rounding).
With a sliding window the keys before the window of a chunk's first query hold NaN: the
kernel must not read them.
"""

from __future__ import annotations

import pytest
import torch
from paged_case import finite, make_case, poison_before, quantize_case, rel_err

from pdserve.kernels.reference.paged_attention import (
    paged_prefill_attention_int8_ref,
    paged_prefill_attention_ref,
)
from pdserve.kernels.triton.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_int8,
)

BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

CASES = [  # (dtype, block_size, head_dim, group, num_kv_heads), as in the decode tests
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
# (query_len, context_len): a 1-token prompt; a 21-token chunk after a 1979-token cached
# prefix; a whole 37-token prompt; a 20-token chunk after 30 cached tokens.
SEQS = [(1, 1), (21, 2000), (37, 37), (20, 50)]


def _inputs(dtype, num_heads, head_dim, seqs):
    query_lens = torch.tensor([n for n, _ in seqs])
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    q = torch.randn(int(query_lens.sum()), num_heads, head_dim).to(dtype)
    return q, query_start_loc


def _ref(case, q, query_start_loc, **variant):
    c = finite(case)
    return paged_prefill_attention_ref(q.float(), c.k_cache.float(), c.v_cache.float(),
                                       c.block_tables, query_start_loc, c.context_lens, 0.1,
                                       **variant)


def _window_firsts(seqs, sliding_window):
    """Each sequence's first key visible to its chunk's first query."""
    return [max(0, c - n - sliding_window + 1) for n, c in seqs]


@pytest.mark.parametrize("dtype,block_size,head_dim,group,num_kv_heads", CASES)
def test_prefill_matches_reference(dtype, block_size, head_dim, group, num_kv_heads):
    case = make_case([c for _, c in SEQS], block_size, num_kv_heads, head_dim, dtype,
                     seed=block_size * group)
    q, query_start_loc = _inputs(dtype, num_kv_heads * group, head_dim, SEQS)
    out = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                  query_start_loc, case.context_lens, 0.1)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, _ref(case, q, query_start_loc)) < BOUND[dtype]


def test_prefill_long_chunk_spans_tiles():
    """A chunk longer than one query tile (64 rows / group 1): causal mask across tiles."""
    seqs = [(150, 170), (3, 3)]
    case = make_case([c for _, c in seqs], 16, 1, 64, torch.float32, seed=5)
    q, query_start_loc = _inputs(torch.float32, 1, 64, seqs)
    out = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                  query_start_loc, case.context_lens, 0.1, max_query_len=150)
    assert rel_err(out, _ref(case, q, query_start_loc)) < 1e-5


# (dtype, block_size, sliding_window, soft_cap): windows of 1 key, shorter than the chunks and
# no multiple of the block size, longer than every context; caps that change random scores.
VARIANT_CASES = [
    (torch.float32, 16, 24, 2.0),
    (torch.float32, 8, 1, None),
    (torch.bfloat16, 16, 1000, 1.5),
]
# chunks that start mid-context (after 179 and 30 cached tokens), a whole prompt, 1 token
VARIANT_SEQS = [(1, 1), (21, 200), (37, 37), (20, 50)]


@pytest.mark.parametrize("dtype,block_size,sliding_window,soft_cap", VARIANT_CASES)
def test_prefill_window_and_soft_cap_match_reference(dtype, block_size, sliding_window,
                                                     soft_cap):
    case = make_case([c for _, c in VARIANT_SEQS], block_size, 2, 64, dtype, seed=block_size)
    q, query_start_loc = _inputs(dtype, 4, 64, VARIANT_SEQS)
    variant = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    poisoned = poison_before(case, _window_firsts(VARIANT_SEQS, sliding_window))
    out = paged_prefill_attention(q, poisoned.k_cache, poisoned.v_cache, case.block_tables,
                                  query_start_loc, case.context_lens, 0.1, **variant)
    assert rel_err(out, _ref(case, q, query_start_loc, **variant)) < BOUND[dtype]


def test_prefill_window_in_a_chunk_spanning_tiles():
    """Three query tiles of one chunk, each starting its keys at its own first window."""
    seqs = [(150, 170)]
    case = make_case([170], 16, 1, 64, torch.float32, seed=8)
    q, query_start_loc = _inputs(torch.float32, 1, 64, seqs)
    poisoned = poison_before(case, _window_firsts(seqs, 30))
    out = paged_prefill_attention(q, poisoned.k_cache, poisoned.v_cache, case.block_tables,
                                  query_start_loc, case.context_lens, 0.1, max_query_len=150,
                                  sliding_window=30)
    assert rel_err(out, _ref(case, q, query_start_loc, sliding_window=30)) < 1e-5


def test_prefill_int8_window_and_soft_cap_match_reference():
    seqs = [(20, 120), (9, 9)]
    case = quantize_case(make_case([c for _, c in seqs], 16, 1, 64, torch.float32, seed=6))
    q, query_start_loc = _inputs(torch.float32, 2, 64, seqs)
    args = (case.block_tables, query_start_loc, case.context_lens, 0.1)
    variant = {"sliding_window": 33, "soft_cap": 2.0}
    c = finite(case)
    ref = paged_prefill_attention_int8_ref(q, c.k_cache, c.v_cache, c.k_scale, c.v_scale,
                                           *args, **variant)
    p = poison_before(case, _window_firsts(seqs, 33))
    out = paged_prefill_attention_int8(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, *args,
                                       **variant)
    assert rel_err(out, ref) < 1e-5


def test_prefill_rejects_bad_query_start_loc():
    case = make_case([5, 6], 16, 1, 64, torch.float32)
    q = torch.randn(11, 2, 64)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                torch.tensor([0, 5], dtype=torch.int32), case.context_lens, 0.1)
