"""A Ray cluster over `netns` hosts, started as docs/deploy.md tells users, and `pdserve up` on it.

`ray_cluster` runs `ray start --head --block` in the head host and `ray start --address ...
--block` in each other host with its custom resources (foreground: their processes are the
hosts' processes, stopped with the hosts). Ray's token authentication as the docs say: one
token for the cluster (a file of this run's own, by RAY_AUTH_TOKEN_PATH, never ~/.ray), every
node started with RAY_AUTH_MODE=token, and `pdserve up` with RAY_AUTH_MODE unset, sending the
token it finds. `pdserve_up` runs `pdserve up --ray-address <head>:<port> --worker-host auto`
in the head host and reads its log: the address it serves on, its metrics port, and the
address each worker came up at.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from pdserve.proto import pdserve_pb2
from tests.e2e.harness import stats, wait_until
from tests.hosts.netns import Network

RAY = str(Path(sys.executable).with_name("ray"))
GCS_PORT = 6379  # the head host's own network namespace: nothing else binds there
NODE_START_S = 120.0
UP_S = 240.0
OBJECT_STORE_BYTES = 80 << 20  # Ray's minimum is 75 MiB; nothing goes through it here
RAY_STARTED = "Ray runtime started."


@dataclass(frozen=True)
class RayCluster:
    address: str  # <head address>:<GCS port>
    env: dict[str, str]  # what a driver joining it needs (token path, no auth mode)
    tmpdir: str


def ray_cluster(network: Network, head: str, nodes: Mapping[str, tuple[int, dict]],
                tmpdir: str) -> RayCluster:
    """Ray's head in `head` (no CPUs: it runs the driver only), and one node per other host:
    `nodes[host] = (num_cpus, custom resources)`; sessions, logs and the token in `tmpdir`
    (short: Ray's socket paths are limited to 107 bytes). Its processes are the hosts': they
    stop with them (`ray stop` would stop every Ray of the machine)."""
    token = Path(tmpdir, "auth_token")
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    env |= {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_TOKEN_PATH": str(token)}
    address = f"{network.hosts[head].address}:{GCS_PORT}"
    started = time.monotonic()
    logs = [_ray_start(network, head, tmpdir, env, [
        "--head", "--port", str(GCS_PORT), "--num-cpus", "0", "--include-dashboard", "false"])]
    _wait_for_port(network.hosts[head].address, GCS_PORT, NODE_START_S)  # the others join it
    logs += [_ray_start(network, host, tmpdir, env, [
        "--address", address, "--num-cpus", str(cpus), "--resources", json.dumps(resources)])
        for host, (cpus, resources) in nodes.items()]
    _wait_for_line(logs, RAY_STARTED, NODE_START_S)  # each node registered
    print(f"ray cluster of {len(nodes) + 1} hosts up in {time.monotonic() - started:.1f} s")
    return RayCluster(address, env, tmpdir)


def _ray_start(network: Network, host: str, tmpdir: str, env: dict[str, str],
               args: list[str]) -> Path:
    log = Path(tmpdir, f"ray-{host}.log")
    with open(log, "w") as out:
        network.popen(host, [
            RAY, "start", "--block", "--node-ip-address", network.hosts[host].address,
            "--temp-dir", f"{tmpdir}/{host}", "--object-store-memory", str(OBJECT_STORE_BYTES),
            "--disable-usage-stats", *args], env={**env, "RAY_AUTH_MODE": "token"},
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return log


def _wait_for_port(host: str, port: int, timeout: float) -> None:
    """Until `host:port` accepts a connection (from here: the bridge reaches every host)."""
    end = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def _wait_for_line(logs: list[Path], line: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(line in log.read_text() for log in logs):
            return
        time.sleep(0.2)
    tails = {log.name: log.read_text()[-2000:] for log in logs if line not in log.read_text()}
    raise AssertionError(f"ray start: no {line!r} within {timeout:g} s: {tails}")


@dataclass
class Deployment:
    """`pdserve up` running in a host, as its log tells it."""

    popen: subprocess.Popen
    lines: list[str] = field(default_factory=list)  # its log so far (stdout and stderr)
    address: str = ""  # the router's gRPC address
    metrics_url: str = ""

    def worker_addresses(self) -> dict[str, str]:
        """Every worker's gRPC address, the latest its log named (a restart moves it)."""
        found: dict[str, str] = {}
        for line in list(self.lines):
            if match := re.search(r"worker (\S+) (?:up|back) at (\S+?:\d+)", line):
                found[match[1]] = match[2]
        return found

    def log_since(self, start: int) -> str:
        return "".join(self.lines[start:])

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line)


@contextlib.contextmanager
def pdserve_up(network: Network, host: str, cluster: RayCluster, model_dir: str,
               flags: list[str], env: Mapping[str, str]) -> Iterator[Deployment]:
    """`pdserve up` joined to `cluster`, in `host`, its router on the host's address; yields
    once it serves. Stopped with the hosts (every process in them)."""
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--ray-address", cluster.address,
            "--worker-host", "auto", "--host", network.hosts[host].address, "--port", "0",
            "--http-port", "0", "--metrics-port", "0", "--model", model_dir, *flags]
    started = time.monotonic()
    popen = network.popen(host, argv, env={**cluster.env, **env}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    deployment = Deployment(popen)
    threading.Thread(target=deployment._read, daemon=True).start()
    end = time.monotonic() + UP_S
    while not deployment.address:
        for line in list(deployment.lines):
            if match := re.search(r"pdserve is serving \S+ on (\S+:\d+).*metrics: (\S+)\)",
                                  line):
                deployment.address, deployment.metrics_url = match[1], match[2]
        if popen.poll() is not None or time.monotonic() > end:
            time.sleep(0.2)  # the reader thread's last lines
            raise AssertionError("pdserve up did not come up:\n" + deployment.log_since(0))
        time.sleep(0.2)
    print(f"pdserve up serving on {deployment.address} in {time.monotonic() - started:.1f} s")
    yield deployment


def actor_processes(network: Network) -> dict[str, list[str]]:
    """The worker processes (Ray actors, by class) in each host's network namespace."""
    found = {}
    for host in network.hosts:
        found[host] = []
        for pid in network.pids(host):
            try:
                title = psutil.Process(pid).cmdline()[0]
            except (psutil.Error, IndexError):
                continue  # gone meanwhile
            if title.startswith(("ray::PrefillActor", "ray::DecodeRankActor")):
                found[host].append(title.split()[0].split(".")[0])  # "ray::Class.method ..."
    return found


def settled(network: Network, address: str, workers: list[str],
            actors: Mapping[str, list[str]], timeout: float) -> pdserve_pb2.Stats:
    """Wait until `workers` are all up and hold no block, nothing is queued or in flight,
    and each host runs the worker processes of `actors` (none left over from a relaunch)."""
    def check():
        now = stats(address)
        found = {w.worker_id: w for w in now.workers}
        ok = (sorted(found) == sorted(workers)
              and all(w.up and w.num_used_blocks == 0 for w in found.values())
              and now.num_queued == 0 and now.num_inflight == 0
              and actor_processes(network) == actors)
        return ok and now

    try:
        return wait_until(check, timeout, "every worker up and idle, the router empty")
    except AssertionError:
        print(stats(address), actor_processes(network))
        raise
