"""Random paged KV batches for the kernel tests, with the dense data they were built from."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pdserve.kernels.kv_quant import SCALE_DTYPE, quantize_kv_ref


@dataclass
class PagedCase:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, a random permutation of ids
    context_lens: torch.Tensor  # [num_seqs] int32
    keys: list[torch.Tensor]  # per sequence [context_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    k_scale: torch.Tensor | None = None  # int8 cases only
    v_scale: torch.Tensor | None = None


def make_case(
    lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    garbage: float = float("nan"),
) -> PagedCase:
    """Every slot no sequence owns (tails of last blocks, spare blocks, table padding) holds
    `garbage`: NaN proves a kernel never reads it; a large finite value proves a masked read.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, garbage, dtype=dtype)
    v_cache = torch.full(shape, garbage, dtype=dtype)
    # Padding entries point at a spare block, so reading one reads garbage, not a crash.
    block_tables = torch.full((len(lens), max(blocks) + 1), int(perm[-1]), dtype=torch.int32)
    keys, values, used = [], [], 0
    for s, (n, nb) in enumerate(zip(lens, blocks, strict=True)):
        ids = perm[used : used + nb]
        used += nb
        block_tables[s, :nb] = ids.int()
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        tokens = torch.arange(n)
        slots = ids[tokens // block_size] * block_size + tokens % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        keys.append(k)
        values.append(v)
    return PagedCase(k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32),
                     keys, values)


def quantize_case(case: PagedCase, garbage_scale: float = float("nan")) -> PagedCase:
    """The same batch in the int8 format; unowned slots get `garbage_scale` as their scale."""
    k_q, k_s = quantize_kv_ref(torch.nan_to_num(case.k_cache))
    v_q, v_s = quantize_kv_ref(torch.nan_to_num(case.v_cache))
    owned = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)
    block_size = case.k_cache.shape[1]
    for s, n in enumerate(case.context_lens.tolist()):
        slots = torch.arange(n)
        owned[case.block_tables[s, slots // block_size].long(), slots % block_size] = True
    k_s = k_s.masked_fill(~owned[..., None], garbage_scale).to(SCALE_DTYPE)
    v_s = v_s.masked_fill(~owned[..., None], garbage_scale).to(SCALE_DTYPE)
    return PagedCase(k_q, v_q, case.block_tables, case.context_lens, case.keys, case.values,
                     k_s, v_s)


def finite(case: PagedCase) -> PagedCase:
    """The torch path reads unowned slots with zero weight: give it finite garbage."""
    return PagedCase(
        torch.nan_to_num(case.k_cache, nan=0.0), torch.nan_to_num(case.v_cache, nan=0.0),
        case.block_tables, case.context_lens, case.keys, case.values,
        None if case.k_scale is None else torch.nan_to_num(case.k_scale, nan=0.0),
        None if case.v_scale is None else torch.nan_to_num(case.v_scale, nan=0.0),
    )


def poison_before(case: PagedCase, firsts: list[int]) -> PagedCase:
    """The same batch with sequence s's slots before position `firsts[s]` holding NaN (their
    scales, in an int8 case): a kernel that never reads them (the keys before a sliding
    window) gives what it gave before; one that reads them, even with weight 0, gives NaN."""
    names = ("k_cache", "v_cache") if case.k_scale is None else ("k_scale", "v_scale")
    poisoned = {name: getattr(case, name).clone() for name in names}
    block_size = case.k_cache.shape[1]
    for s, first in enumerate(firsts):
        positions = torch.arange(first)
        blocks = case.block_tables[s, positions // block_size].long()
        for t in poisoned.values():
            t[blocks, positions % block_size] = float("nan")
    return replace(case, **poisoned)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative norm error; NaN anywhere (an unwritten, poisoned element) fails every bound."""
    diff = (out.double() - ref.double()).norm() / ref.double().norm()
    return float("inf") if torch.isnan(diff) else float(diff)
