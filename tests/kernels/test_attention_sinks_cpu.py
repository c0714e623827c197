"""Attention sinks (gpt-oss) in the C paged attention (`kernels/cpu/paged_decode_attention.c`):
decode and prefill against the reference, on every path this CPU takes (fp32; bf16 on its
AVX512-BF16 or AVX2 path, and head_dim 80 on the generic one), with and without a window.

Bounds as test_decode_kernel_cpu.py (relative norm error against the fp32 reference): fp32
1e-5, bf16 1e-2. Sinks are drawn N(0, 2^2): they move every output far past those bounds.
Unowned slots and the keys before each window hold NaN (never read).
"""

from __future__ import annotations

import pytest
import torch
from paged_case import finite, make_case, poison_before, rel_err

from pdserve.kernels.cpu import build
from pdserve.kernels.cpu.paged_attention import (
    available,
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
)
from pdserve.kernels.reference.paged_attention import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)

BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SHAPES = [(16, 64, 3, 3), (32, 128, 1, 2), (16, 80, 8, 1)]  # block, head_dim, group, kv heads
LENS = [1, 300, 37, 16]
SEQS = [(1, 1), (21, 300), (37, 37), (1, 17)]  # (query_len, context_len)


@pytest.fixture(scope="module", autouse=True)
def built():
    assert available(), f"the C kernel did not build (compiler {build._compiler()})"


def sinks_for(num_heads: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads", SHAPES)
def test_decode_with_sinks_matches_reference(dtype, block_size, head_dim, group, num_kv_heads):
    case = make_case(LENS, block_size, num_kv_heads, head_dim, dtype, seed=block_size + group)
    q = torch.randn(len(LENS), num_kv_heads * group, head_dim).to(dtype)
    sinks = sinks_for(num_kv_heads * group)
    c = finite(case)
    for window in (None, 40):
        poisoned = poison_before(case, [max(0, n - (window or n)) for n in LENS])
        out = paged_decode_attention_cpu(q, poisoned.k_cache, poisoned.v_cache,
                                         case.block_tables, case.context_lens, 0.125,
                                         sliding_window=window, sinks=sinks)
        ref = paged_decode_attention_ref(q.float(), c.k_cache.float(), c.v_cache.float(),
                                         c.block_tables, c.context_lens, 0.125,
                                         sliding_window=window, sinks=sinks)
        assert rel_err(out, ref) < BOUND[dtype], window


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads", SHAPES)
def test_prefill_with_sinks_matches_reference(dtype, block_size, head_dim, group, num_kv_heads):
    """A decode query per token (runs of positions: 4 to a tile on AVX2)."""
    case = make_case([n for _, n in SEQS], block_size, num_kv_heads, head_dim, dtype,
                     seed=group)
    query_lens = torch.tensor([n for n, _ in SEQS])
    starts = torch.zeros(len(SEQS) + 1, dtype=torch.int32)
    starts[1:] = query_lens.cumsum(0)
    q = torch.randn(int(query_lens.sum()), num_kv_heads * group, head_dim).to(dtype)
    sinks = sinks_for(num_kv_heads * group, seed=1)
    c = finite(case)
    for window in (None, 24):
        firsts = [max(0, ctx - n - (window or ctx) + 1) for n, ctx in SEQS]
        poisoned = poison_before(case, firsts)
        out = paged_prefill_attention_cpu(q, poisoned.k_cache, poisoned.v_cache,
                                          case.block_tables, starts, case.context_lens, 0.1,
                                          sliding_window=window, sinks=sinks)
        ref = paged_prefill_attention_ref(q.float(), c.k_cache.float(), c.v_cache.float(),
                                          c.block_tables, starts, c.context_lens, 0.1,
                                          sliding_window=window, sinks=sinks)
        assert rel_err(out, ref) < BOUND[dtype], window


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_minus_infinity_sinks_are_no_sinks(dtype):
    """A sink of -inf adds nothing to a denominator: the same bits as without sinks."""
    case = make_case(LENS, 16, 3, 64, dtype, seed=2)
    q = torch.randn(len(LENS), 9, 64).to(dtype)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    assert torch.equal(paged_decode_attention_cpu(*args, sinks=torch.full((9,), -torch.inf)),
                       paged_decode_attention_cpu(*args))


def test_lone_queries_on_more_threads_give_the_same_bits():
    """With fewer queries than threads an item is one KV head (AVX2): its heads' sinks are
    that head's. Each lone query on 2 and 4 threads equals the batch on 1 thread."""
    case = make_case([300, 5, 64], 16, 4, 64, torch.bfloat16, seed=7)
    q = torch.randn(3, 8, 64).bfloat16()
    sinks = sinks_for(8, seed=3)
    threads = torch.get_num_threads()

    def attend(rows, n):
        torch.set_num_threads(n)
        return paged_decode_attention_cpu(q[rows], case.k_cache, case.v_cache,
                                          case.block_tables[rows], case.context_lens[rows],
                                          0.125, sinks=sinks)

    try:
        whole = attend(slice(0, 3), 1)
        for n in (2, 4):
            for i in range(3):
                assert torch.equal(attend(slice(i, i + 1), n)[0], whole[i]), (n, i)
    finally:
        torch.set_num_threads(threads)


def test_fp16_falls_back_to_the_reference_with_sinks():
    case = finite(make_case([40, 3], 16, 2, 64, torch.float16, seed=5))
    q, sinks = torch.randn(2, 4, 64).half(), sinks_for(4)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    assert torch.equal(paged_decode_attention_cpu(*args, sinks=sinks),
                       paged_decode_attention_ref(*args, sinks=sinks))


def test_rejects_bad_sinks():
    case = make_case([5], 16, 2, 64, torch.float32)
    args = (torch.randn(1, 4, 64), case.k_cache, case.v_cache, case.block_tables,
            case.context_lens, 0.125)
    with pytest.raises(ValueError, match="sinks must have shape"):
        paged_decode_attention_cpu(*args, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="sinks must have dtype"):
        paged_decode_attention_cpu(*args, sinks=torch.zeros(4, dtype=torch.float64))
