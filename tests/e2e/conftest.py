"""What the e2e modules share: a real two-node Ray cluster (the head carries "prefill", the
second node "decode"), the default deployment on the tiny model, and its offline engine.

One of each for the whole package: a cluster's start and stop cost ~7 s, a service's ~10 s.
Modules that need other settings start their own service on the same cluster (a service stops
every actor and placement group it started), which has room for the largest of them beside the
shared one; the shared service serves modules that leave it as they found it (every request
ended, every block free: each test checks).
"""

from __future__ import annotations

import pytest

from pdserve.llm import LLM
from tests.e2e.harness import MAX_INFLIGHT, MAX_QUEUED, free_port, running, tiny_settings
from tests.ray_cluster import local_cluster

# (logical CPUs, resources) per node: room for a module's own service (up to 2 prefill workers,
# a decode TP-2 group or 2 decode workers) beside the package's shared one
NODES = [(4, {"prefill": 4}), (8, {"decode": 4})]
# A deployment publishes its workers in Ray's GCS under its namespace: the shared service takes
# its own, so a module's deployment (and its `--router-only` routers) finds only its own workers
SHARED_NAMESPACE = "e2e-shared"


@pytest.fixture(scope="package")
def ray_cluster():
    with local_cluster(NODES) as cluster:
        yield cluster


@pytest.fixture(scope="package")
def tiny_service(ray_cluster, tiny_llama_dir, tiny_lora_dirs, tmp_path_factory):
    """1 prefill + 1 decode worker, the router with its gRPC and OpenAI HTTP fronts, Redis;
    the tiny model's three LoRA adapters served over it (two per engine step); KV tiers (host
    and disk) under both workers' pools, so every module's checks that no block is left held
    and that the tokens are the offline engine's also hold with the tiers' copies running.
    Chat replies' reasoning is split off as Qwen3's (`--reasoning-parser qwen3`): only a reply
    that opens `<think>` has any, which the tiny model never writes unless a grammar makes it
    (tests/e2e/test_structured_outputs.py), so every other chat answer is its plain text."""
    modules = " ".join(f"{name}={path}" for name, path in sorted(tiny_lora_dirs.items()))
    settings = tiny_settings(tiny_llama_dir, ray_cluster.address, http_port=free_port(),
                             max_inflight_requests=MAX_INFLIGHT, max_queued_requests=MAX_QUEUED,
                             redis_namespace=SHARED_NAMESPACE, enable_lora=True,
                             lora_modules=modules, max_loras=2, kv_host_bytes=64 * 8192,
                             kv_disk_path=str(tmp_path_factory.mktemp("kv-disk")),
                             kv_disk_bytes=4 << 20,  # 64 blocks in host, ~480 on disk
                             reasoning_parser="qwen3")
    with running(settings) as service:
        yield service


@pytest.fixture(scope="package")
def offline(tiny_llama_dir) -> LLM:
    """The offline engine on the tiny model, as the services are configured."""
    return LLM(str(tiny_llama_dir), max_model_len=512, num_kv_blocks=256, num_threads=1)
