"""A real multi-node Ray cluster on 127.0.0.1 for tests, in this process tree only.

Every node is a separate raylet with its own custom resources, as on a real cluster; the
session lives in a short temp dir (Ray's socket paths are limited to 107 bytes) that goes
away with it. Stops only what it started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence


@contextlib.contextmanager
def local_cluster(nodes: Sequence[tuple[int, dict[str, float]]]) -> Iterator:
    """`nodes`: (num_cpus, custom resources) per node, the first is the head. Yields the
    cluster with this process connected to it as the driver."""
    from ray.cluster_utils import Cluster

    from pdserve.launch.ray_runtime import start_ray, stop_ray

    tmpdir = tempfile.mkdtemp(prefix="pdray", dir="/tmp")
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_TMPDIR=tmpdir, RAY_USAGE_STATS_ENABLED="0")
    started = time.monotonic()
    (head_cpus, head_resources), *others = nodes
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "resources": dict(head_resources),
        "node_ip_address": "127.0.0.1", "include_dashboard": False,
    })
    try:
        for num_cpus, resources in others:
            cluster.add_node(num_cpus=num_cpus, resources=dict(resources),
                             node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        start_ray(cluster.address, {}, None, tmpdir)
        print(f"ray cluster of {len(nodes)} nodes up in {time.monotonic() - started:.1f} s")
        yield cluster
    finally:
        stop_ray()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(tmpdir, ignore_errors=True)
