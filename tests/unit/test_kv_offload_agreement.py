"""KVOffload on a tensor-parallel group: a copy is reported only once every rank finished it, and
as failed if any rank failed it. Two offloads stand for two ranks, each on a thread of this
test; their `agree` is a sum over both, met at a barrier as a real all-reduce would be. One
rank's copy thread is held back to show a copy landed on one rank alone is not reported."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from pdserve.engine.block_hash import hash_blocks
from pdserve.engine.kv_offload import KVOffload
from pdserve.engine.kv_tiers import TierOps, TierResults

BS = 4
TOKENS = tuple(range(BS))
HASH = hash_blocks(TOKENS, BS)[0]


class Sum:
    """An all-reduce (sum) of two ranks that each call it from their own thread."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=10)
        self.parts: dict[int, torch.Tensor] = {}

    def of(self, rank: int):
        def agree(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x.clone()
            self.barrier.wait()
            total = self.parts[0] + self.parts[1]
            self.barrier.wait()
            return total
        return agree


def offload(tmp_path, rank: int, agree) -> KVOffload:
    caches = [(torch.randn(4, BS, 1, 8), torch.randn(4, BS, 1, 8))]
    block_nbytes = 2 * BS * 8 * 4
    return KVOffload(caches, 4 * block_nbytes, str(tmp_path / f"rank{rank}"), 1 << 20,
                     {"rank": rank}, agree)


def both(ranks, call) -> list:
    """`call(offload)` on both ranks at once (as each rank's step would)."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(call, ranks))


def test_a_copy_is_reported_once_every_rank_has_it(tmp_path, monkeypatch):
    total = Sum()
    ranks = [offload(tmp_path, r, total.of(r)) for r in range(2)]
    release = threading.Event()
    copy = KVOffload._copy

    def slow_on_rank1(self, slot, block_id, to_device):
        if self is ranks[1] and not to_device:
            assert release.wait(10)
        copy(self, slot, block_id, to_device)

    monkeypatch.setattr(KVOffload, "_copy", slow_on_rank1)
    for r in ranks:
        r.start(TierOps(stores=((2, 1),)))
    ranks[0]._running[0][0].result(timeout=10)  # rank 0's copy thread has landed it ...
    for _ in range(3):  # ... so neither rank reports it, however often they ask
        assert both(ranks, lambda r: r.results()) == [TierResults()] * 2
    assert all(r.busy for r in ranks)
    release.set()
    assert both(ranks, lambda r: r.results(wait=True)) == [TierResults(stored=(1,))] * 2
    assert not any(r.busy for r in ranks)
    assert both(ranks, lambda r: r.results()) == [TierResults()] * 2  # reported once


def test_a_copy_that_failed_on_one_rank_failed_on_all(tmp_path):
    total = Sum()
    ranks = [offload(tmp_path, r, total.of(r)) for r in range(2)]
    ranks[0].disk.write(HASH, TOKENS, bytes(ranks[0].block_nbytes))  # rank 1 has no file
    promote = TierOps(promotions=((HASH, TOKENS, 3),))
    stores = TierOps(stores=((0, 0),))
    for r in ranks:
        r.start(promote)
        r.start(stores)  # a later batch, fine everywhere: reported with it
    got = both(ranks, lambda r: r.results(wait=True))
    assert got == [TierResults(stored=(0,), failed_promotions=(HASH,))] * 2


def test_a_single_rank_reports_what_it_finished(tmp_path):
    single = offload(tmp_path, 0, None)
    single.start(TierOps(stores=((1, 2),)))
    assert single.results(wait=True) == TierResults(stored=(2,))
    assert not single.busy
