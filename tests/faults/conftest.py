"""Shared fixtures for the fault-injection suite: a real Ray cluster and what a service holds.

`ray_cluster`: two real raylets on 127.0.0.1 (head: "prefill", second node: "decode"), one for the
package (a module's service stops every actor and placement group it started). `tiny_service`:
the default deployment on the tiny model, shared by the modules that end every case with it
quiescent (one service start, ~10 s, instead of one per module). `slow_model_dir`: a random
Llama big enough that prefilling a few thousand tokens takes about a second on one CPU thread,
so a test can act while a prefill (and its KV transfer) is under way. `quiescent`: waits until
a running service holds nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.e2e.harness import ServiceThread, running, stats, tiny_settings, wait_until
from tests.ray_cluster import local_cluster
from tests.tiny_models import write_tiny_model

# 8 layers of width 256: a 3000-token prompt prefills in ~1 s on one thread of this CPU
# (measured), against ~10 ms for the 2-layer test model; kv heads 2 split over TP=2.
SLOW_MODEL = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 8,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096}

# (logical CPUs, resources) per node: room for a module's own service (up to 2 prefill workers,
# a decode TP-2 group or 2 decode workers) beside the package's shared one
NODES = [(4, {"prefill": 4}), (8, {"decode": 4})]
# A killed actor gets SIGTERM, then SIGKILL after Ray's kill_worker_timeout_milliseconds (5 s
# by default). A SIGSTOPped worker never handles the SIGTERM, so each relaunch of one
# (tests/faults/test_kill_matrix.py) waited those 5 s for its old process to go; the SIGKILL
# is what ends it either way.
RAY_ENV = {"RAY_kill_worker_timeout_milliseconds": "500"}


@pytest.fixture(scope="package")
def ray_cluster():
    with local_cluster(NODES, RAY_ENV) as cluster:
        yield cluster


@pytest.fixture(scope="package")
def tiny_service(ray_cluster, tiny_llama_dir):
    # its own namespace: a deployment publishes its workers in Ray's GCS under it
    settings = tiny_settings(tiny_llama_dir, ray_cluster.address, redis_namespace="faults-shared")
    with running(settings) as service:
        yield service


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    """The tiny checkpoint's router-side context (tokenizer, limits) for routers built in-process
    over scripted workers (router_fakes); a module may override it (e.g. a shorter context)."""
    from pdserve.router.validation import ModelContext

    return ModelContext.load(str(tiny_llama_dir), "tiny")


@pytest.fixture(scope="session")
def slow_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("slow-llama"), "llama", seed=3,
                            **SLOW_MODEL)


def held_by_workers(service: ServiceThread) -> dict[str, int]:
    """Used KV blocks of every worker the router has up now (its polled GetLoad)."""
    return {w.worker_id: w.num_used_blocks for w in stats(service.address).workers if w.up}


def wait_quiescent(service: ServiceThread, num_workers: int, timeout: float) -> None:
    """Until every one of `num_workers` workers is up and holds 0 used blocks and the router
    holds no flight; AssertionError naming what is still held after `timeout` seconds."""
    def idle() -> bool:
        held = held_by_workers(service)
        return (len(held) == num_workers and not any(held.values())
                and not service.router.flights)

    try:
        wait_until(idle, timeout, "quiescent")
    except AssertionError:
        raise AssertionError(
            f"not quiescent within {timeout} s: used blocks of up workers "
            f"{held_by_workers(service)} (want {num_workers} workers at 0), router flights "
            f"{sorted(service.router.flights)}") from None


@pytest.fixture
def quiescent() -> Callable[[ServiceThread, int, float], None]:
    """`quiescent(service, num_workers, timeout)`: see `wait_quiescent`."""
    return wait_quiescent
