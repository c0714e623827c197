"""The pool owner dies and comes back (issue 39, item 2): `pdserve up --ray-address` (a real
subprocess) over 1 prefill + 1 decode worker, and `pdserve up --router-only` beside it, both
on an external Redis, one cluster secret. The owner is SIGKILLed while both routers stream:
its workers are detached actors of the deployment, so nothing restarts; the other router's
streams finish identical and new requests keep being served there. A replacement owner (the
same command) adopts the running workers (the same processes) instead of starting new ones,
and serves; at the end no worker holds a KV block.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from pdserve import cluster_secret
from pdserve.cluster_secret import ClusterSecret
from pdserve.launch.redis_server import RedisServer
from pdserve.proto import worker_pb2, worker_pb2_grpc
from tests.e2e.harness import (
    free_port,
    greedy_stream,
    offline_greedy,
    stop_process,
    token_prompts,
    wait_until,
)

DEPLOYMENT = "owner-restart"  # its registry and its workers' names: this module's own
REDIS_PASSWORD = "owner-restart-redis"
START_S = 120.0
WORKERS = ("decode-0", "prefill-0")


class Up:
    """`pdserve up` (an owner, or `--router-only`) as a subprocess; its log read by a thread."""

    def __init__(self, ray_address: str, model_dir, redis_url: str, secret: ClusterSecret,
                 log_path, router_only: bool = False) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "pdserve.cli", "up", *(["--router-only"] * router_only),
                "--ray-address", ray_address, "--model", str(model_dir), "--max-model-len",
                "512", "--port", self.address.rsplit(":", 1)[1], "--metrics-port", "0",
                "--http-port", "0", "--router-processes", "1", "--redis-url", redis_url,
                "--redis-namespace", DEPLOYMENT]
        if not router_only:
            argv += ["--num-kv-blocks", "256", "--prefill-threads", "1", "--decode-threads", "1"]
        env = {**os.environ, "PDSERVE_REDIS_PASSWORD": REDIS_PASSWORD,
               cluster_secret.ENV: secret.value.decode()}
        self.log_path = log_path
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.new: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                self.lines.append(line)
                self.new.put(line)

    def wait_serving(self) -> None:
        wait_until(lambda: any(line.startswith("pdserve is serving") and self.address in line
                               for line in self.lines) or self.proc.poll() is not None,
                   START_S, "pdserve up serving")
        assert self.proc.poll() is None, f"pdserve up exited; see {self.log_path}"

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture(scope="module")
def secret():
    return ClusterSecret.generate()


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer(0, password=REDIS_PASSWORD) as server:
        yield f"redis://{server.host}:{server.port}/0"  # the password goes by env


def worker_pids() -> dict[str, int]:
    """Each worker of the deployment: its running actor's process (from Ray, by name)."""
    import ray

    pids = {}
    for name in ray.util.list_named_actors():
        deployment, worker_id, _, rank = name.split("/")
        if deployment == DEPLOYMENT and rank == "0":
            pids[worker_id] = ray.get(ray.get_actor(name).pid.remote(), timeout=10)
    return pids


def used_blocks(address: str, role: str, secret: ClusterSecret) -> int:
    stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill"
            else worker_pb2_grpc.DecodeWorkerStub)
    with grpc.insecure_channel(address) as channel:
        return stub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5,
                                     metadata=secret.grpc_metadata()).num_used_blocks


async def stream(address: str, request_id: str, prompt, max_tokens: int,
                 started: asyncio.Event | None = None):
    async with grpc.aio.insecure_channel(address) as channel:
        return await greedy_stream(channel, request_id, prompt, max_tokens, started)


def test_owner_killed_then_replaced_adopts_the_workers(ray_cluster, tiny_llama_dir, offline,
                                                       secret, redis_url, tmp_path):
    owner = Up(ray_cluster.address, tiny_llama_dir, redis_url, secret, tmp_path / "owner.log")
    other = replacement = None
    try:
        owner.wait_serving()
        other = Up(ray_cluster.address, tiny_llama_dir, redis_url, secret,
                   tmp_path / "router-only.log", router_only=True)
        other.wait_serving()
        before = worker_pids()
        assert sorted(before) == sorted(WORKERS), before
        prompts = token_prompts(6, seed=21)
        expected = offline_greedy(offline, prompts, 200)
        later = token_prompts(4, seed=22)
        expected_later = offline_greedy(offline, later, 8)

        async def through_the_kill():
            started = [asyncio.Event() for _ in prompts]
            on_other = [asyncio.create_task(stream(other.address, f"k-{i}", p, 200, e))
                        for i, (p, e) in enumerate(zip(prompts, started))]
            on_owner = asyncio.create_task(stream(owner.address, "k-owner", prompts[0], 200))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            owner.proc.send_signal(signal.SIGKILL)  # the owner dies mid-stream
            owner.proc.wait(10)
            killed = time.monotonic()
            served = []  # new requests while no owner runs: one every 0.5 s
            for i, p in enumerate(later):
                served.append(await stream(other.address, f"after-{i}", p, 8))
                await asyncio.sleep(0.5)
            return await asyncio.gather(*on_other), await on_owner, served, killed

        outcomes, owners_own, served, killed = asyncio.run(through_the_kill())
        assert outcomes == [("length", t) for t in expected]  # the other router's, untouched
        assert owners_own[0] != "length"  # its router died with it
        assert served == [("length", t) for t in expected_later]
        assert worker_pids() == before  # nothing restarted

        replacement = Up(ray_cluster.address, tiny_llama_dir, redis_url, secret,
                         tmp_path / "replacement.log")
        replacement.wait_serving()
        adopted = [line for line in replacement.lines if " adopted at " in line]
        assert len(adopted) == len(WORKERS), "".join(replacement.lines[-50:])
        assert worker_pids() == before  # adopted: the same processes
        print(f"owner replaced and serving {time.monotonic() - killed:.1f} s after the kill")

        async def both():
            return await asyncio.gather(*(stream(a, f"back-{i}", p, 8) for i, (a, p) in
                                          enumerate(zip([replacement.address, other.address]
                                                        * 2, later))))

        assert asyncio.run(both()) == [("length", t) for t in expected_later]
        addresses = {w: line.rsplit(" ", 1)[1].strip() for line in adopted
                     for w in WORKERS if f"worker {w} adopted" in line}
        wait_until(lambda: all(used_blocks(a, w.split("-")[0], secret) == 0
                               for w, a in addresses.items()), 30, "no KV block held")
    finally:
        for up in (replacement, other, owner):
            if up is not None:
                up.stop()
    wait_until(lambda: not worker_pids(), 30, "the deployment's workers stopped with it")
