"""The CPU backend's prefill attention (a decode query per token) against the reference.

Bounds (relative norm error against the reference evaluated in fp32 on the same inputs):
fp32 1e-5; bf16 1e-2 (inputs and output rounded to bf16). Unowned cache slots hold NaN, so a
read past a sequence's length or through a padding entry of its block table fails the test;
with a sliding window, so do the keys before the chunk's first query's window.
"""

from __future__ import annotations

import pytest
import torch
from paged_case import finite, make_case, poison_before, rel_err

from pdserve.kernels.attention_metadata import (
    AttentionMetadata,
    DecodeMetadata,
    PrefillMetadata,
)
from pdserve.kernels.backend import get_backend
from pdserve.kernels.cpu.paged_attention import paged_prefill_attention_cpu
from pdserve.kernels.reference.paged_attention import paged_prefill_attention_ref

BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# (query_len, context_len): a 1-token prompt; a chunk after a long cached prefix; whole prompts
# of several lengths (one spanning blocks unevenly); a chunk after 30 cached tokens; a
# 1-token chunk after a prefix (a decode-shaped prefill).
SEQS = [(1, 1), (21, 300), (37, 37), (20, 50), (130, 130), (1, 17)]


def _inputs(dtype, num_heads, head_dim, seqs, seed):
    gen = torch.Generator().manual_seed(seed)
    query_lens = torch.tensor([n for n, _ in seqs])
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    q = torch.randn(int(query_lens.sum()), num_heads, head_dim, generator=gen).to(dtype)
    return q, query_start_loc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads",
                         [(16, 64, 3, 3), (32, 128, 1, 2), (16, 80, 8, 1), (1, 64, 2, 2)])
def test_matches_reference(dtype, block_size, head_dim, group, num_kv_heads):
    case = make_case([c for _, c in SEQS], block_size, num_kv_heads, head_dim, dtype,
                     seed=block_size + group)
    q, starts = _inputs(dtype, num_kv_heads * group, head_dim, SEQS, seed=group)
    out = paged_prefill_attention_cpu(q, case.k_cache, case.v_cache, case.block_tables,
                                      starts, case.context_lens, 0.1)
    c = finite(case)
    ref = paged_prefill_attention_ref(q.float(), c.k_cache.float(), c.v_cache.float(),
                                      c.block_tables, starts, c.context_lens, 0.1)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, ref) < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads",
                         [(16, 64, 3, 3), (32, 128, 1, 2), (16, 80, 8, 1)])
def test_window_and_soft_cap_match_reference(dtype, block_size, head_dim, group, num_kv_heads):
    """Windows of 1 key, shorter than the chunks and contexts and no multiple of a block size
    (each query's window starts elsewhere, chunks start mid-context), longer than every
    context; a cap alone and with a window."""
    case = make_case([c for _, c in SEQS], block_size, num_kv_heads, head_dim, dtype,
                     seed=block_size + group)
    q, starts = _inputs(dtype, num_kv_heads * group, head_dim, SEQS, seed=group)
    c = finite(case)
    for window, cap in [(1, None), (24, None), (50, 2.0), (5000, None), (None, 1.5)]:
        firsts = [max(0, ctx - n - (window or ctx) + 1) for n, ctx in SEQS]
        poisoned = poison_before(case, firsts)
        out = paged_prefill_attention_cpu(q, poisoned.k_cache, poisoned.v_cache,
                                          case.block_tables, starts, case.context_lens, 0.1,
                                          sliding_window=window, soft_cap=cap)
        ref = paged_prefill_attention_ref(q.float(), c.k_cache.float(), c.v_cache.float(),
                                          c.block_tables, starts, c.context_lens, 0.1,
                                          sliding_window=window, soft_cap=cap)
        assert rel_err(out, ref) < BOUND[dtype], (window, cap)


def test_fp16_caches_take_the_reference():
    """The C kernel takes fp32 and bf16 caches; fp16 ones go to the reference, unchanged."""
    case = finite(make_case([c for _, c in SEQS], 16, 2, 64, torch.float16, seed=3))
    q, starts = _inputs(torch.float16, 4, 64, SEQS, seed=3)
    args = (q, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens, 0.1)
    assert torch.equal(paged_prefill_attention_cpu(*args), paged_prefill_attention_ref(*args))
    variant = {"sliding_window": 24, "soft_cap": 2.0}
    assert torch.equal(paged_prefill_attention_cpu(*args, **variant),
                       paged_prefill_attention_ref(*args, **variant))


def test_each_sequence_sees_only_its_own_causal_past():
    """Changing a key a query may not see (a later token of its own sequence, or another
    sequence's) leaves that query's output exactly as it was."""
    seqs = [(40, 40), (24, 60)]
    case = make_case([c for _, c in seqs], 16, 2, 64, torch.float32, seed=7)
    q, starts = _inputs(torch.float32, 4, 64, seqs, seed=7)
    args = (case.block_tables, starts, case.context_lens, 0.125)
    before = paged_prefill_attention_cpu(q, case.k_cache, case.v_cache, *args)
    # sequence 0's last key (position 39) and all of sequence 1's last block
    k = case.k_cache.clone()
    k[case.block_tables[0, 2], 39 - 32] += 5.0
    k[case.block_tables[1, 3]] += 5.0  # positions 48..59: queries 36.. of seq 1 see them
    after = paged_prefill_attention_cpu(q, k, case.v_cache, *args)
    assert torch.equal(after[:39], before[:39])  # seq 0, queries 0..38 never see position 39
    assert not torch.equal(after[39], before[39])
    seq1 = slice(40, 64)  # seq 1's queries sit at positions 36..59
    assert torch.equal(after[seq1][:12], before[seq1][:12])  # positions 36..47
    assert not torch.equal(after[seq1][12:], before[seq1][12:])


def test_backend_attention_passes_the_variants_to_both_ops():
    """A mixed step (two decodes, a chunk after 80 cached tokens) through `attention`: the cpu
    backend's C ops agree with the torch backend's references with a window and a cap, and
    differ from what they give without them (so both ops got them)."""
    lens, chunk = [100, 30, 100], 20  # the last sequence is the prefill
    case = finite(make_case(lens, 16, 2, 64, torch.float32, seed=12))
    new = [(0, 99), (1, 29), *((2, t) for t in range(100 - chunk, 100))]  # (seq, position)
    slots = torch.tensor([int(case.block_tables[s, t // 16]) * 16 + t % 16 for s, t in new])
    k = torch.stack([case.keys[s][t] for s, t in new])  # what the cache already holds there
    v = torch.stack([case.values[s][t] for s, t in new])
    meta = AttentionMetadata(
        slots, 2, DecodeMetadata(case.block_tables[:2], case.context_lens[:2], 100),
        PrefillMetadata(case.block_tables[2:], torch.tensor([0, chunk], dtype=torch.int32),
                        case.context_lens[2:], chunk, 100))
    q = torch.randn(len(new), 4, 64)
    kv_cache = (case.k_cache, case.v_cache)
    variant = {"sliding_window": 24, "soft_cap": 2.0}
    out = get_backend("cpu", "cpu").attention(q, k, v, kv_cache, meta, 0.125, **variant)
    ref = get_backend("cpu", "torch").attention(q, k, v, kv_cache, meta, 0.125, **variant)
    plain = get_backend("cpu", "torch").attention(q, k, v, kv_cache, meta, 0.125)
    assert rel_err(out, ref) < 1e-5
    for rows in (slice(0, 2), slice(2, None)):  # the decodes, the chunk
        assert rel_err(out[rows], plain[rows]) > 1e-2


def test_is_the_cpu_backends():
    assert get_backend("cpu", "cpu").paged_prefill_attention is paged_prefill_attention_cpu
