"""Triton paged prefill attention against the torch reference (interpreter, small shapes).

Bounds as for decode (relative norm error against the fp32 reference on the same inputs):
fp32 1e-5; fp16 2e-3; bf16 1e-2 (the interpreter truncates to bf16 instead of rounding).
"""

from __future__ import annotations

import pytest
import torch
from paged_case import finite, make_case, rel_err

from pdserve.kernels.reference.paged_attention import paged_prefill_attention_ref
from pdserve.kernels.triton.paged_prefill_attention import paged_prefill_attention

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


def _ref(case, q, query_start_loc):
    c = finite(case)
    return paged_prefill_attention_ref(q.float(), c.k_cache.float(), c.v_cache.float(),
                                       c.block_tables, query_start_loc, c.context_lens, 0.1)


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


def test_prefill_rejects_bad_query_start_loc():
    case = make_case([5, 6], 16, 1, 64, torch.float32)
    q = torch.randn(11, 2, 64)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                torch.tensor([0, 5], dtype=torch.int32), case.context_lens, 0.1)
