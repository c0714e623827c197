"""A real multi-node Ray cluster on 127.0.0.1 for tests, in this process tree only.

Every node is a separate raylet with its own custom resources, as on a real cluster; the
session lives in a short temp dir (Ray's socket paths are limited to 107 bytes) that goes
away with it. Stops only what it started.

A start is tried up to START_ATTEMPTS times: Ray forks its daemons with a Python
`preexec_fn`, and a fork from this many-threaded process (gRPC, Ray, torch threads left by
earlier modules) now and then hangs in the child before it execs, so the raylet never
registers and Ray gives up after 30 s ("The current node timed out during startup"; seen
once in ~30 fresh-clone CI runs). What a failed attempt started, and only that (this
process's new descendants), is killed before the next.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence

import psutil

START_ATTEMPTS = 2


@contextlib.contextmanager
def local_cluster(nodes: Sequence[tuple[int, dict[str, float]]],
                  ray_env: dict[str, str] | None = None) -> Iterator:
    """`nodes`: (num_cpus, custom resources) per node, the first is the head; `ray_env`: more
    environment (RAY_* system config) for the cluster's processes. Yields the cluster with
    this process connected to it as the driver."""
    from pdserve.launch.ray_runtime import start_ray, stop_ray

    ray_env = dict(ray_env or {})
    saved = {k: os.environ.get(k)  # start_ray may set RAY_AUTH_MODE (a token is at hand)
             for k in ("RAY_TMPDIR", "RAY_USAGE_STATS_ENABLED", "RAY_AUTH_MODE", *ray_env)}
    started = time.monotonic()
    tmpdir = cluster = None
    try:
        for attempt in range(1, START_ATTEMPTS + 1):
            tmpdir = tempfile.mkdtemp(prefix="pdray", dir="/tmp")
            os.environ.update(ray_env, RAY_TMPDIR=tmpdir, RAY_USAGE_STATS_ENABLED="0")
            before = _descendants()
            try:
                cluster = _start(nodes)
                break
            except Exception as exc:
                if attempt == START_ATTEMPTS:
                    raise
                print(f"ray cluster start failed ({exc}); killing what it started, again")
                _kill(_descendants() - before)
                shutil.rmtree(tmpdir, ignore_errors=True)
        start_ray(cluster.address, {}, None, tmpdir)
        print(f"ray cluster of {len(nodes)} nodes up in {time.monotonic() - started:.1f} s")
        yield cluster
    finally:
        stop_ray()
        if cluster is not None:
            cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _start(nodes: Sequence[tuple[int, dict[str, float]]]):
    """The cluster, every node registered; on failure, its own started nodes shut down."""
    from ray.cluster_utils import Cluster

    (head_cpus, head_resources), *others = nodes
    cluster = Cluster()
    try:
        cluster.add_node(num_cpus=head_cpus, resources=dict(head_resources),
                         node_ip_address="127.0.0.1", include_dashboard=False)
        for num_cpus, resources in others:
            cluster.add_node(num_cpus=num_cpus, resources=dict(resources),
                             node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def _descendants() -> set[psutil.Process]:
    return set(psutil.Process().children(recursive=True))


def _kill(processes: set[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(list(processes), timeout=10)
