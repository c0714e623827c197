"""KVLayout ids and the TP head-split / resharding math."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.kvtransfer.layout import (
    KVLayout,
    check_kv_caches,
    reshard_routes,
    routes_from,
    routes_to,
    transfer_view,
)
from tests.kvtransfer.kvdata import zero_caches

LAYOUT = KVLayout("m", "float32", 16, 2, 8, 64)


def test_layout_id_is_stable_and_sensitive_to_every_field() -> None:
    assert LAYOUT.layout_id == KVLayout("m", "float32", 16, 2, 8, 64).layout_id
    assert len(LAYOUT.layout_id) == 16
    changes = [{"model": "m2"}, {"dtype": "bfloat16"}, {"block_size": 32}, {"num_layers": 3},
               {"num_kv_heads": 4}, {"head_dim": 128}, {"num_kv_heads": 1, "kind": "latent"},
               {"num_kv_heads": 1}]
    changed = [dataclasses.replace(LAYOUT, **c) for c in changes]
    ids = {LAYOUT.layout_id} | {c.layout_id for c in changed}
    assert len(ids) == 9


@pytest.mark.parametrize("kwargs", [
    {"model": ""}, {"dtype": "int4"}, {"block_size": 0}, {"num_layers": -1},
    {"num_kv_heads": True}, {"head_dim": 64.0}, {"block_size": 1 << 20}, {"kind": "mla"},
    {"kind": "latent"},  # a latent cache is one head
])
def test_layout_refuses_bad_fields(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(LAYOUT, **kwargs)


def test_head_ranges_split_evenly() -> None:
    assert LAYOUT.head_ranges(1) == [(0, 8)]
    assert LAYOUT.head_ranges(4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    smollm2 = KVLayout("SmolLM2-135M", "float32", 16, 30, 3, 64)
    with pytest.raises(ValueError, match=r"split evenly over TP=2; use a TP size in \[1, 3\]"):
        smollm2.head_ranges(2)
    with pytest.raises(ValueError):
        LAYOUT.head_ranges(0)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_reshard_routes_cover_every_head_once(p: int, d: int) -> None:
    routes = reshard_routes(LAYOUT, p, d)
    src, dst = LAYOUT.head_ranges(p), LAYOUT.head_ranges(d)
    covered = []
    for r in routes:
        assert src[r.source_rank][0] <= r.head_start < r.head_end <= src[r.source_rank][1]
        assert dst[r.dest_rank][0] <= r.head_start < r.head_end <= dst[r.dest_rank][1]
        covered += range(r.head_start, r.head_end)
    assert sorted(covered) == list(range(LAYOUT.num_kv_heads))
    for j in range(d):  # each destination gets its whole range, from its sources in order
        mine = routes_to(LAYOUT, j, p, d)
        assert [h for r in mine for h in range(r.head_start, r.head_end)] == list(range(*dst[j]))
    for i in range(p):
        assert routes_from(LAYOUT, i, p, d) == [r for r in routes if r.source_rank == i]
    assert len(routes) == max(p, d)  # nested splits: one route per finer rank


def test_reshard_examples() -> None:
    assert [(r.source_rank, r.dest_rank, r.head_start, r.head_end)
            for r in reshard_routes(LAYOUT, 2, 4)] == [
        (0, 0, 0, 2), (0, 1, 2, 4), (1, 2, 4, 6), (1, 3, 6, 8)]
    assert [(r.source_rank, r.dest_rank, r.head_start, r.head_end)
            for r in reshard_routes(LAYOUT, 2, 1)] == [(0, 0, 0, 4), (1, 0, 4, 8)]
    six = KVLayout("m", "float32", 16, 2, 6, 64)  # non-nested: TP 2 -> TP 3
    assert [(r.source_rank, r.dest_rank, r.head_start, r.head_end)
            for r in reshard_routes(six, 2, 3)] == [
        (0, 0, 0, 2), (0, 1, 2, 3), (1, 1, 3, 4), (1, 2, 4, 6)]
    with pytest.raises(ValueError, match="TP=4"):
        reshard_routes(six, 2, 4)


def test_block_nbytes_of_smollm2() -> None:
    smollm2 = KVLayout("SmolLM2-135M", "float32", 16, 30, 3, 64)
    assert smollm2.block_nbytes(3) == 2 * 16 * 3 * 64 * 4


def test_check_kv_caches_names_the_problem() -> None:
    caches = zero_caches(LAYOUT, 4, 8)
    assert check_kv_caches(LAYOUT, caches, 8) == torch.device("cpu")
    with pytest.raises(ValueError, match="layers"):
        check_kv_caches(LAYOUT, caches[:1], 8)
    with pytest.raises(ValueError, match="heads of this rank"):
        check_kv_caches(LAYOUT, caches, 4)
    bad = [(k.half(), v) for k, v in caches]
    with pytest.raises(ValueError, match="float32"):
        check_kv_caches(LAYOUT, bad, 8)


LATENT = KVLayout("deepseek", "bfloat16", 16, 3, 1, 288, "latent")  # V3's 512 + 64 entry


@pytest.mark.parametrize(("p", "d"), [(1, 1), (1, 2), (2, 1), (2, 4)])
def test_a_latent_cache_goes_whole_to_every_destination_rank(p: int, d: int) -> None:
    assert LATENT.head_ranges(d) == [(0, 1)] * d
    routes = reshard_routes(LATENT, p, d)
    assert [(r.source_rank, r.dest_rank, r.head_start, r.head_end) for r in routes] == [
        (j % p, j, 0, 1) for j in range(d)]
    for j in range(d):
        assert routes_to(LATENT, j, p, d) == [routes[j]]
    assert sum(len(routes_from(LATENT, i, p, d)) for i in range(p)) == d


def test_a_latent_entry_travels_as_its_two_halves() -> None:
    cache = torch.randn(5, 16, 576).to(torch.bfloat16)
    ((k, v),) = transfer_view(LATENT, [(cache,)])
    assert k.shape == v.shape == (5, 16, 1, 288)
    assert torch.equal(torch.cat([k, v], dim=-1).squeeze(2), cache)
    k[2, 3, 0, 0] = -1.0  # views: a transfer landing in them lands in the cache
    assert cache[2, 3, 0] == -1.0
    assert LATENT.block_nbytes(1) == 16 * 576 * 2  # a block's entries' bytes, no more
    check_kv_caches(LATENT, [(k, v)] * 3, 1)
