"""Where a decode group's ranks may go (`--decode-tp-placement`): what each strategy asks of
the cluster's nodes (`Worker.node_bundles`) and the pool's check that some nodes hold it
(`fits_apart`), against a brute-force search over every assignment of bundles to nodes."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from pdserve.cluster_secret import ClusterSecret
from pdserve.launch.pool import fits_apart
from pdserve.launch.worker import DECODE, PREFILL, Worker
from pdserve.worker_spec import WorkerSpec

SECRET = ClusterSecret.generate()


def worker(role: str, tp: int, placement: str, cpus: float = 2) -> Worker:
    spec = WorkerSpec(worker_id="w", model="m", model_name="m")
    return Worker(spec, role, tp, cpus, False, secret=SECRET, tp_placement=placement)


def test_each_strategy_asks_what_it_binds():
    rank0, rank = Counter({"CPU": 2, DECODE: 1}), Counter({"CPU": 2})
    assert worker(DECODE, 3, "STRICT_PACK").node_bundles() == [Counter({"CPU": 6, DECODE: 1})]
    assert worker(DECODE, 3, "STRICT_SPREAD").node_bundles() == [rank0, rank, rank]
    for free in ("PACK", "SPREAD"):  # Ray places ranks as they fit: the totals are checked
        assert worker(DECODE, 3, free).node_bundles() == []
    assert worker(PREFILL, 1, "STRICT_SPREAD").node_bundles() == []
    with pytest.raises(ValueError, match="tp_placement must be one of"):
        worker(DECODE, 2, "ANYWHERE")


def brute_force(bundles: list[Counter], nodes: list[dict]) -> bool:
    return any(all(all(nodes[j].get(k, 0) >= n for k, n in b.items())
                   for b, j in zip(bundles, chosen))
               for chosen in itertools.permutations(range(len(nodes)), len(bundles)))


def test_fits_apart_equals_the_brute_force_search():
    rng = random.Random(5)
    seen = Counter()
    for _ in range(3000):
        nodes = [{"CPU": rng.choice([0, 1, 2, 4])} | ({DECODE: 1} if rng.random() < 0.4 else {})
                 for _ in range(rng.randint(1, 5))]
        tp, cpus = rng.randint(1, 4), rng.choice([1, 2])
        bundles = worker(DECODE, tp, rng.choice(["STRICT_PACK", "STRICT_SPREAD"]),
                         cpus).node_bundles()
        want = brute_force(bundles, nodes)
        assert fits_apart(bundles, nodes) == want, (bundles, nodes)
        seen[want] += 1
    assert min(seen.values()) > 300  # both answers, often
