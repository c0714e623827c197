"""The C paged decode attention (`kernels/cpu/paged_decode_attention.c`) against the reference.

Bounds (relative norm error against the reference evaluated in fp32 on the same inputs):
fp32 1e-5; bf16 1e-2 (the output is rounded to bf16). Unowned cache slots hold NaN, so a
read past a sequence's length or through a padding entry of its block table fails the test;
with a sliding window, so do the keys before each window (the kernel must skip them).
"""

from __future__ import annotations

import pytest
import torch
from paged_case import finite, make_case, poison_before, rel_err

from pdserve.kernels.backend import get_backend
from pdserve.kernels.cpu import build
from pdserve.kernels.cpu.paged_attention import available, paged_decode_attention_cpu
from pdserve.kernels.reference.paged_attention import paged_decode_attention_ref

BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LENS = [1, 700, 37, 16, 129]


@pytest.fixture(scope="module", autouse=True)
def built():
    """A machine that runs the tests has a C compiler: not building is a failure, not a skip."""
    assert available(), f"the C kernel did not build (compiler {build._compiler()})"


def _ref(case, q, **variant):
    c = finite(case)
    return paged_decode_attention_ref(q.float(), c.k_cache.float(), c.v_cache.float(),
                                      c.block_tables, c.context_lens, 0.125, **variant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads",
                         [(16, 64, 3, 3), (32, 128, 1, 2), (16, 80, 8, 1), (1, 64, 2, 2)])
def test_matches_reference(dtype, block_size, head_dim, group, num_kv_heads):
    case = make_case(LENS, block_size, num_kv_heads, head_dim, dtype, seed=block_size + group)
    q = torch.randn(len(LENS), num_kv_heads * group, head_dim).to(dtype)
    out = paged_decode_attention_cpu(q, case.k_cache, case.v_cache, case.block_tables,
                                     case.context_lens, 0.125)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, _ref(case, q)) < BOUND[dtype]


# (sliding_window, soft_cap): a window of 1 key; windows shorter than most contexts and not a
# multiple of any block size; one longer than every context; a cap alone (small enough to
# change random scores: Gemma 2's 50 would barely bite).
VARIANTS = [(1, None), (40, None), (100, 2.0), (5000, 1.5), (None, 2.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads",
                         [(16, 64, 3, 3), (32, 128, 1, 2), (16, 80, 8, 1), (1, 64, 2, 2)])
def test_window_and_soft_cap_match_reference(dtype, block_size, head_dim, group, num_kv_heads):
    """Every path (fp32; bf16 on this CPU's path and, head_dim 80, the generic one), the keys
    before each window poisoned."""
    case = make_case(LENS, block_size, num_kv_heads, head_dim, dtype, seed=block_size + group)
    q = torch.randn(len(LENS), num_kv_heads * group, head_dim).to(dtype)
    for window, cap in VARIANTS:
        firsts = [max(0, n - (window or n)) for n in LENS]
        poisoned = poison_before(case, firsts)
        out = paged_decode_attention_cpu(q, poisoned.k_cache, poisoned.v_cache,
                                         case.block_tables, case.context_lens, 0.125,
                                         sliding_window=window, soft_cap=cap)
        ref = _ref(case, q, sliding_window=window, soft_cap=cap)
        assert rel_err(out, ref) < BOUND[dtype], (window, cap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_past_every_context_is_no_window(dtype):
    """A window no context exceeds reads what full attention reads: the same bits."""
    case = make_case(LENS, 16, 3, 64, dtype, seed=9)
    q = torch.randn(len(LENS), 9, 64).to(dtype)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    assert torch.equal(paged_decode_attention_cpu(*args, sliding_window=700),
                       paged_decode_attention_cpu(*args))


def test_strided_query_int64_tables_and_threads():
    """q as a view of a fused qkv row; int64 tables; the same result on 1 and 2 threads."""
    case = make_case([300, 9, 64], 16, 2, 64, torch.bfloat16, seed=4)
    qkv = torch.randn(3, 8, 64).to(torch.bfloat16)
    q = qkv[:, :4]  # row stride 8 * 64
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(paged_decode_attention_cpu(
                q, case.k_cache, case.v_cache, case.block_tables.long(), case.context_lens,
                0.125, max_context_len=300))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], _ref(case, q)) < BOUND[torch.bfloat16]


def test_runs_of_positions_match_each_query_alone():
    """Consecutive positions of one sequence share a work item (a prefill chunk's tokens, 4 to
    a tile on AVX2): runs of 7 and 2, a position that follows on in length but in another
    sequence whose table shares only the first block (it must not join), and one that shares
    every block it reads (it may). Each output equals that query run alone, and the reference."""
    case = make_case([64, 64], 16, 3, 64, torch.bfloat16, seed=11)
    a, b = case.block_tables[0], case.block_tables[1].clone()
    b[0] = a[0]  # b's first 16 tokens are a's (a shared prefix block)
    items = [(a, n) for n in range(17, 24)] + [(b, 24), (b, 25), (a, 5), (b, 3), (a, 4)]
    tables = torch.stack([t for t, _ in items])
    lens = torch.tensor([n for _, n in items], dtype=torch.int32)
    q = torch.randn(len(items), 9, 64).bfloat16()
    out = paged_decode_attention_cpu(q, case.k_cache, case.v_cache, tables, lens, 0.125)
    for i in range(len(items)):
        alone = paged_decode_attention_cpu(q[i:i + 1], case.k_cache, case.v_cache,
                                           tables[i:i + 1], lens[i:i + 1], 0.125)
        assert torch.equal(out[i], alone[0]), i
    c = finite(case)
    expected = paged_decode_attention_ref(q.float(), c.k_cache.float(), c.v_cache.float(),
                                          tables, lens, 0.125)
    assert rel_err(out, expected) < BOUND[torch.bfloat16]


@pytest.mark.parametrize("head_dim,group,num_kv_heads", [(64, 3, 3), (128, 2, 2), (64, 1, 4)])
def test_fewer_queries_than_threads_give_the_same_bits(head_dim, group, num_kv_heads):
    """With fewer queries than threads, work items are single KV heads (a lone sequence's
    heads share the cores): each output is the same bits as on one thread, where an item reads
    whole rows. Lone decodes on 2 and 4 threads, and on 4 threads three queries: decodes of
    three sequences, then three consecutive positions of one (a tile of one KV head)."""
    case = make_case([700, 5, 64], 16, num_kv_heads, head_dim, torch.bfloat16, seed=head_dim)
    heads = num_kv_heads * group
    q = torch.randn(6, heads, head_dim).bfloat16()
    run = [(case.block_tables[i], int(case.context_lens[i])) for i in range(3)]
    run += [(case.block_tables[0], n) for n in (98, 99, 100)]
    tables = torch.stack([t for t, _ in run])
    lens = torch.tensor([n for _, n in run], dtype=torch.int32)

    def attend(rows, n):
        torch.set_num_threads(n)
        return paged_decode_attention_cpu(q[rows], case.k_cache, case.v_cache, tables[rows],
                                          lens[rows], 0.125)

    threads = torch.get_num_threads()
    try:
        whole = attend(slice(0, 6), 1)
        for n in (2, 4):
            for i in range(6):
                assert torch.equal(attend(slice(i, i + 1), n)[0], whole[i]), (n, i)
        assert torch.equal(attend(slice(0, 3), 4), whole[:3])
        assert torch.equal(attend(slice(3, 6), 4), whole[3:])
    finally:
        torch.set_num_threads(threads)
    c = finite(case)
    expected = paged_decode_attention_ref(q.float(), c.k_cache.float(), c.v_cache.float(),
                                          tables, lens, 0.125)
    assert rel_err(whole, expected) < BOUND[torch.bfloat16]


def test_rejects_bad_inputs():
    case = make_case([5], 16, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="does not match the cache's heads"):
        paged_decode_attention_cpu(torch.randn(1, 3, 64), case.k_cache, case.v_cache,
                                   case.block_tables, case.context_lens, 0.125)
    with pytest.raises(ValueError, match="q must have dtype"):
        paged_decode_attention_cpu(torch.randn(1, 4, 64).bfloat16(), case.k_cache,
                                   case.v_cache, case.block_tables, case.context_lens, 0.125)
    with pytest.raises(ValueError, match="block_tables must have shape"):
        paged_decode_attention_cpu(torch.randn(1, 4, 64), case.k_cache, case.v_cache,
                                   case.block_tables[:0], case.context_lens, 0.125)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention_cpu(torch.randn(1, 4, 64), case.k_cache, case.v_cache,
                                   case.block_tables, case.context_lens, 0.125,
                                   sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        paged_decode_attention_cpu(torch.randn(1, 4, 64), case.k_cache, case.v_cache,
                                   case.block_tables, case.context_lens, 0.125, soft_cap=-1.0)


def test_cpu_backend_is_the_default_and_falls_back_for_fp16():
    cpu = get_backend(torch.device("cpu"))
    assert cpu.name == "cpu"
    case = finite(make_case([40, 3], 16, 2, 64, torch.float16, seed=5))  # the reference reads
    q = torch.randn(2, 4, 64).half()  # unowned slots with weight 0: they must be finite
    out = cpu.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                     case.context_lens, 0.125)
    assert rel_err(out, _ref(case, q)) < 2e-3


def test_disabled_by_env_means_the_torch_backend(monkeypatch, tmp_path):
    monkeypatch.setenv(build.DISABLE_ENV, "0")
    build.load.cache_clear()
    build.function.cache_clear()
    try:
        assert build.load("paged_decode_attention") is None
        assert get_backend(torch.device("cpu")).name == "torch"
    finally:
        monkeypatch.undo()
        build.load.cache_clear()
        build.function.cache_clear()
    assert get_backend(torch.device("cpu")).name == "cpu"
