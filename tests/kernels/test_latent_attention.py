"""Multi-head latent attention (MLA): the Triton kernels (interpreter, tiny shapes) and the C
absorbed decode against `kernels.reference.latent_attention`, and the reference's absorbed
decode (`KernelBackend.latent_attention`) against the plain formulation.

Bounds (relative norm error against the reference evaluated in fp32 on the same inputs):
fp32 1e-5; fp16 2e-3; bf16 1e-2 (the interpreter truncates to bf16 instead of rounding; the C
kernel rounds its bf16 output). Store and gather are copies: exact. Every cache slot no
sequence owns (tails of last blocks, spare blocks, table padding) holds NaN, and so does every
output before a kernel writes it (`new_output` under the interpreter; `out=` for the C kernel),
so a read past a sequence's length or a missed write fails the comparison.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from paged_case import rel_err

from pdserve.kernels.attention_metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata
from pdserve.kernels.backend import KernelBackend, get_backend
from pdserve.kernels.cpu import build
from pdserve.kernels.cpu.latent_attention import available, paged_latent_decode_attention_cpu
from pdserve.kernels.reference.latent_attention import (
    gather_latent_ref,
    paged_latent_decode_attention_ref,
    prefill_attention_ref,
    store_latent_ref,
)
from pdserve.kernels.triton.latent_attention import (
    gather_latent,
    paged_latent_decode_attention,
    prefill_attention,
    store_latent,
)
from tests.kernel_device import kernel_device

GPU_MODE = kernel_device(os.environ) == "cuda"  # the Triton kernels compiled, on CUDA
BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
NAN = float("nan")


@dataclass
class LatentCase:
    cache: torch.Tensor  # [num_blocks, block_size, entry_dim], NaN where no sequence owns
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, a random permutation of ids
    context_lens: torch.Tensor  # [num_seqs] int32
    entries: list[torch.Tensor]  # per sequence [context_len, entry_dim]


def _slots(table: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    tokens = torch.arange(n)
    return table[tokens // block_size].long() * block_size + tokens % block_size


def latent_case(lens: list[int], block_size: int, entry_dim: int, dtype: torch.dtype,
                seed: int = 0) -> LatentCase:
    """Sequences of `lens` entries in randomly placed blocks; table padding points at a spare
    block, so reading through it reads NaN, not out of bounds."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=gen).int()
    cache = torch.full((num_blocks, block_size, entry_dim), NAN, dtype=dtype)
    tables = torch.full((len(lens), max(blocks) + 1), int(perm[-1]), dtype=torch.int32)
    entries, used = [], 0
    for s, (n, nb) in enumerate(zip(lens, blocks, strict=True)):
        tables[s, :nb] = perm[used:used + nb]
        used += nb
        entry = torch.randn(n, entry_dim, generator=gen).to(dtype)
        cache.view(-1, entry_dim)[_slots(tables[s], n, block_size)] = entry
        entries.append(entry)
    return LatentCase(cache, tables, torch.tensor(lens, dtype=torch.int32), entries)


def _decode_ref(case: LatentCase, q: torch.Tensor, rank: int) -> torch.Tensor:
    return paged_latent_decode_attention_ref(q.float(), case.cache.float(), case.block_tables,
                                             case.context_lens, 0.1, 129, rank)


# ---- store / gather: copies, exact ----


@pytest.mark.parametrize("dtype,block_size,entry_dim", [(torch.float32, 16, 48),
                                                        (torch.bfloat16, 8, 32),
                                                        (torch.float16, 16, 576)])
def test_store_latent_matches_reference(dtype, block_size, entry_dim):
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(5, block_size, entry_dim, generator=gen).to(dtype)  # missed slots show
    slots = torch.randperm(5 * block_size, generator=gen)[:13]
    entry = torch.randn(13, entry_dim, generator=gen).to(dtype)
    ref = cache.clone()
    store_latent_ref(entry, ref, slots)
    store_latent(entry, cache, slots)
    assert torch.equal(cache, ref)


def test_store_latent_casts_strided_input_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(2)
    fused = torch.randn(7, 40, generator=gen)  # entries as a view of a wider projection
    entry = fused[:, 4:28]
    slots = torch.tensor([3, -1, 17, 0, 30, -1, 9])
    cache = torch.zeros(4, 8, 24, dtype=torch.float16)
    ref = cache.clone()
    store_latent(entry, cache, slots)
    keep = slots >= 0
    store_latent_ref(entry[keep], ref, slots[keep])
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("dtype,block_size,entry_dim", [(torch.float32, 16, 40),
                                                        (torch.bfloat16, 8, 24)])
def test_gather_latent_matches_reference(dtype, block_size, entry_dim):
    case = latent_case([1, 70, 37, 16], block_size, entry_dim, dtype, seed=3)
    out = gather_latent(case.cache, case.block_tables, case.context_lens)
    assert torch.equal(out, gather_latent_ref(case.cache, case.block_tables, case.context_lens))
    assert torch.equal(out, torch.cat(case.entries))


# ---- absorbed decode ----

# (dtype, block_size, rank, rope, num_heads): non-power-of-2 ranks; one and two head blocks
# (20 heads: the second block partial); DeepSeek-V3's 512 + 64 at 16 heads (one TP-8 rank).
DECODE_CASES = [
    (torch.float32, 16, 32, 16, 5),
    (torch.float32, 8, 24, 8, 20),
    (torch.float16, 8, 24, 8, 3),
    (torch.bfloat16, 16, 32, 16, 20),
    (torch.bfloat16, 16, 512, 64, 16),
]
DECODE_LENS = [1, 70, 37, 16]  # a 1-entry context; several blocks; none a block multiple


@pytest.mark.parametrize("dtype,block_size,rank,rope,num_heads", DECODE_CASES)
def test_triton_decode_matches_reference(dtype, block_size, rank, rope, num_heads):
    case = latent_case(DECODE_LENS, block_size, rank + rope, dtype, seed=block_size + rank)
    q = torch.randn(len(DECODE_LENS), num_heads, rank + rope).to(dtype)
    ref = _decode_ref(case, q, rank)
    # one program per (sequence, head block), and split-K with the merge kernel (3 splits)
    for num_splits in (1, 3):
        out = paged_latent_decode_attention(q, case.cache, case.block_tables,
                                            case.context_lens, 0.1, 70, rank,
                                            num_splits=num_splits)
        assert out.dtype == dtype and out.shape == (len(DECODE_LENS), num_heads, rank)
        assert rel_err(out, ref) < BOUND[dtype], num_splits


@pytest.fixture
def c_kernel():
    """A machine that runs the tests has a C compiler: not building is a failure, not a skip
    (GPU mode tests the Triton kernels; the C one has its CPU run)."""
    if GPU_MODE:
        pytest.skip("GPU mode: the C kernel is tested on the CPU run")
    assert available(), f"the C kernel did not build (compiler {build._compiler()})"


CPU_LENS = [1, 70, 37, 16, 129]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,rank,rope,num_heads",
                         [(16, 32, 16, 5), (8, 24, 8, 20), (16, 512, 64, 16), (1, 40, 3, 33)])
def test_cpu_decode_matches_reference(c_kernel, dtype, block_size, rank, rope, num_heads):
    case = latent_case(CPU_LENS, block_size, rank + rope, dtype, seed=block_size + rank)
    q = torch.randn(len(CPU_LENS), num_heads, rank + rope).to(dtype)
    out = torch.full((len(CPU_LENS), num_heads, rank), NAN, dtype=dtype)
    got = paged_latent_decode_attention_cpu(q, case.cache, case.block_tables, case.context_lens,
                                            0.1, 129, rank, out=out)
    assert got is out
    assert rel_err(out, _decode_ref(case, q, rank)) < BOUND[dtype]


def test_cpu_decode_strided_and_mixed_dtypes(c_kernel):
    """fp32 queries (token-strided, a slice of a wider tensor) against a bf16 cache, int64
    tables; an fp16 cache runs the reference."""
    case = latent_case(CPU_LENS, 16, 40, torch.bfloat16, seed=5)
    wide = torch.randn(len(CPU_LENS), 6, 40)
    q = wide[:, 1:4]
    out = paged_latent_decode_attention_cpu(q, case.cache, case.block_tables.long(),
                                            case.context_lens.long(), 0.1, 129, 32)
    assert out.dtype == torch.float32
    assert rel_err(out, _decode_ref(case, q, 32)) < BOUND[torch.bfloat16]
    half = latent_case(CPU_LENS, 16, 40, torch.float16, seed=6)
    q = q.half()
    out = paged_latent_decode_attention_cpu(q, half.cache, half.block_tables,
                                            half.context_lens, 0.1, 129, 32)
    assert rel_err(out, _decode_ref(half, q, 32)) < BOUND[torch.float16]


def test_wrong_layouts_are_refused(c_kernel):
    case = latent_case([5, 9], 8, 40, torch.float32)
    q = torch.randn(2, 4, 40)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        paged_latent_decode_attention(q, case.cache, case.block_tables, case.context_lens, 0.1,
                                      9, 41)
    with pytest.raises(ValueError, match="q must have shape"):
        paged_latent_decode_attention(q[..., :32], case.cache, case.block_tables,
                                      case.context_lens, 0.1, 9, 32)
    with pytest.raises(ValueError, match="latent cache"):
        paged_latent_decode_attention_cpu(q, case.cache.transpose(0, 1), case.block_tables,
                                          case.context_lens, 0.1, 9, 32)
    with pytest.raises(ValueError, match="entry must have shape"):
        store_latent(torch.randn(3, 41), case.cache, torch.arange(3))


# ---- dense prefill attention ----

# (query_len, context_len): a 1-token prompt; a chunk after a cached prefix spanning several
# key tiles; a whole prompt; a chunk after a short prefix.
PREFILL_SEQS = [(1, 1), (21, 90), (37, 37), (5, 20)]


def _prefill_inputs(dtype, num_heads, qk_dim, v_dim, seqs, seed=0):
    """q, k and v, with NaN rows after the last sequence's keys (read one: NaN out)."""
    gen = torch.Generator().manual_seed(seed)
    query_lens = torch.tensor([n for n, _ in seqs])
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    num_keys = sum(c for _, c in seqs)
    q = torch.randn(int(query_lens.sum()), num_heads, qk_dim, generator=gen).to(dtype)
    k = torch.randn(num_keys + 3, num_heads, qk_dim, generator=gen).to(dtype)
    v = torch.randn(num_keys + 3, num_heads, v_dim, generator=gen).to(dtype)
    k[num_keys:], v[num_keys:] = NAN, NAN
    context_lens = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    return q, k, v, query_start_loc, context_lens


# (dtype, num_heads, qk_dim, v_dim): qk widths of one power of two, and of a power of two and a
# rest (24 = 16 + 8; 40 = 32 + 8), v narrower than qk and no power of two
PREFILL_CASES = [
    (torch.float32, 2, 24, 16),
    (torch.float32, 1, 32, 12),
    (torch.float16, 2, 40, 24),
    (torch.bfloat16, 3, 24, 16),
]


@pytest.mark.parametrize("dtype,num_heads,qk_dim,v_dim", PREFILL_CASES)
def test_triton_prefill_matches_reference(dtype, num_heads, qk_dim, v_dim):
    q, k, v, qsl, lens = _prefill_inputs(dtype, num_heads, qk_dim, v_dim, PREFILL_SEQS)
    num_keys = int(lens.sum())
    ref = prefill_attention_ref(q.float(), k[:num_keys].float(), v[:num_keys].float(), qsl, lens,
                                0.2)
    out = prefill_attention(q, k[:num_keys], v[:num_keys], qsl, lens, 0.2)
    assert out.dtype == dtype and out.shape == (q.shape[0], num_heads, v_dim)
    assert rel_err(out, ref) < BOUND[dtype]
    # the NaN rows past the last key are never read
    out = prefill_attention(q, k, v, qsl, lens, 0.2, max_query_len=37)
    assert rel_err(out, ref) < BOUND[dtype]


# ---- the whole op: absorbed decode + plain prefill vs the plain formulation ----

H, NOPE, ROPE, RANK, V_DIM, BLOCK = 4, 16, 8, 24, 12, 8
DECODES = [1, 40, 17]  # context lengths incl. the new token
PREFILLS = [(5, 25), (9, 9)]  # (chunk, context incl. the chunk)


def _mixed_step(seed: int = 0):
    """A step of 3 decodes and 2 prefill chunks: the cache holding every sequence's earlier
    entries (NaN elsewhere), the step's inputs, the metadata, and every sequence's entries."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [(1, c) for c in DECODES] + PREFILLS  # (new tokens, context)
    case = latent_case([c for _, c in seqs], BLOCK, RANK + ROPE, torch.float32, seed)
    new = [case.entries[i][c - n:] for i, (n, c) in enumerate(seqs)]
    for i, (n, c) in enumerate(seqs):  # the step's own entries are stored by the op
        case.cache.view(-1, RANK + ROPE)[_slots(case.block_tables[i], c, BLOCK)[c - n:]] = NAN
    slot_mapping = torch.cat([_slots(case.block_tables[i], c, BLOCK)[c - n:]
                              for i, (n, c) in enumerate(seqs)])
    nd = len(DECODES)
    chunk_lens = torch.tensor([n for n, _ in PREFILLS])
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, num_decode_tokens=nd,
        decode=DecodeMetadata(case.block_tables[:nd], case.context_lens[:nd], max(DECODES)),
        prefill=PrefillMetadata(case.block_tables[nd:], torch.cat(
            [torch.zeros(1, dtype=torch.int32), chunk_lens.cumsum(0).int()]),
            case.context_lens[nd:], int(chunk_lens.max()), max(c for _, c in PREFILLS)))
    num_tokens = len(torch.cat(new))
    q_nope = torch.randn(num_tokens, H, NOPE, generator=gen)
    q_pe = torch.randn(num_tokens, H, ROPE, generator=gen)
    return case, seqs, torch.cat(new), q_nope, q_pe, meta


def _plain(entries, n, q_nope, q_pe, w_uk, w_uv, scale):
    """One sequence's last n queries, attention per head with decompressed keys and values, in
    fp64: k_h = [latent W_UK_h^T, k_pe], v_h = latent W_UV_h^T."""
    latent, k_pe = entries[:, :RANK].double(), entries[:, RANK:].double()
    c = entries.shape[0]
    k = torch.cat([torch.einsum("sl,hnl->hsn", latent, w_uk.double()),
                   k_pe.expand(H, c, ROPE)], dim=-1)  # [H, c, nope + rope]
    v = torch.einsum("sl,hvl->hsv", latent, w_uv.double())  # [H, c, v]
    q = torch.cat([q_nope, q_pe], dim=-1).double().transpose(0, 1)  # [H, n, nope + rope]
    scores = q @ k.transpose(1, 2) * scale
    visible = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)  # [n, H, v]


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_latent_attention_equals_plain_attention(name):
    """Absorbed decode (W_UK into the query, W_UV out of the latent output) and the plain
    prefill (latents gathered and expanded) both equal ordinary attention over per-head
    decompressed keys and values, to fp32 rounding; the cache then holds every entry."""
    if name == "cpu" and GPU_MODE:
        pytest.skip("GPU mode: the C kernel is tested on the CPU run")
    ops = KernelBackend() if name == "torch" else get_backend("cpu", name)
    case, seqs, entry, q_nope, q_pe, meta = _mixed_step()
    gen = torch.Generator().manual_seed(7)
    w_uk = torch.randn(H, NOPE, RANK, generator=gen) / RANK**0.5
    w_uv = torch.randn(H, V_DIM, RANK, generator=gen) / RANK**0.5

    def expand(latent):  # the layer's kv_b_proj: [S, rank] -> ([S, H, nope], [S, H, v]),
        # on the latent's device, as the layer's own weights are (GPU mode: CUDA)
        return (torch.einsum("sl,hnl->shn", latent, w_uk.to(latent.device)),
                torch.einsum("sl,hvl->shv", latent, w_uv.to(latent.device)))

    scale = (NOPE + ROPE) ** -0.5
    out = ops.latent_attention(q_nope, q_pe, entry, (case.cache,), meta, scale, w_uk, w_uv,
                               expand)
    plain, start = [], 0
    for i, (n, _) in enumerate(seqs):
        plain.append(_plain(case.entries[i], n, q_nope[start:start + n], q_pe[start:start + n],
                            w_uk, w_uv, scale))
        start += n
    assert out.shape == (len(entry), H, V_DIM)
    assert rel_err(out, torch.cat(plain)) < 1e-5
    stored = gather_latent_ref(case.cache, case.block_tables, case.context_lens)
    assert torch.equal(stored, torch.cat(case.entries))
