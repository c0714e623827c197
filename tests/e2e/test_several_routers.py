"""Two routers over one pool: the service (the pool's owner, in this process) and
`pdserve up --router-only` (a real subprocess) over 2 prefill + 2 decode workers, real Ray,
Redis and gRPC. The second router learns the workers from the registry the owner publishes in
Ray's GCS, shares Redis with it (sessions), and holds its own Outputs subscriptions: when it is
SIGKILLed the decode workers free its requests (the owner lease) while the owner's streams go on.
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
from pdserve.client import Client
from pdserve.cluster_secret import ClusterSecret
from pdserve.engine.sampling_params import SamplingParams
from pdserve.llm import LLM
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e.harness import (
    free_port,
    greedy_stream,
    offline_greedy,
    running,
    stop_process,
    tiny_settings,
    token_prompts,
    wait_until,
)
from tests.tiny_models import write_tiny_model

CONTEXT = 4096
ORPHAN_TOKENS = CONTEXT - 64  # tens of seconds of decoding: freed early only by the lease
REDIS_PASSWORD = "several-routers-redis"
LEASE_S = 5.0  # the acceptance: a dead router's requests freed on every worker within this
START_S = 120.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-4k"), "llama", seed=1,
                            max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def secret():
    """One cluster secret for both routers, through the environment as an operator gives it."""
    saved = os.environ.get(cluster_secret.ENV)
    value = ClusterSecret.generate()
    os.environ[cluster_secret.ENV] = value.value.decode()
    yield value
    if saved is None:
        os.environ.pop(cluster_secret.ENV, None)
    else:
        os.environ[cluster_secret.ENV] = saved


@pytest.fixture(scope="module")
def service(ray_cluster, model_dir, secret):
    settings = tiny_settings(model_dir, ray_cluster.address, prefill_workers=2,
                             decode_workers=2, max_model_len=CONTEXT, num_kv_blocks=2048,
                             redis_password=REDIS_PASSWORD)
    with running(settings) as service:
        yield service


class RouterOnlyProcess:
    """`pdserve up --router-only` as a subprocess; its stdout read by a thread."""

    def __init__(self, ray_address: str, model_dir, log_path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "pdserve.cli", "up", "--router-only",
                "--ray-address", ray_address, "--model", str(model_dir),
                "--max-model-len", str(CONTEXT), "--port", str(self.port),
                "--metrics-port", "0", "--http-port", "0", "--router-processes", "1"]
        env = {**os.environ, "PDSERVE_REDIS_PASSWORD": REDIS_PASSWORD}
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)
        self.lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_serving(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if line.startswith("pdserve is serving") and self.address in line:
                return
        raise AssertionError(f"the router-only process did not serve within {timeout} s "
                             f"(exit {self.proc.poll()}); see {self.log.name}")

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


@pytest.fixture(scope="module")
def second(service, ray_cluster, model_dir, tmp_path_factory):
    router = RouterOnlyProcess(ray_cluster.address, model_dir,
                               tmp_path_factory.mktemp("router-only") / "stderr.log")
    try:
        router.wait_serving(START_S)
        yield router
    finally:
        router.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), max_model_len=CONTEXT, num_kv_blocks=512, num_threads=1)


async def _stream(address: str, request_id: str, prompt: list[int], max_tokens: int,
                  started: asyncio.Event | None = None):
    async with grpc.aio.insecure_channel(address) as channel:
        return await greedy_stream(channel, request_id, prompt, max_tokens, started)


def _router_stats(address: str) -> pdserve_pb2.Stats:
    with grpc.insecure_channel(address) as channel:
        return pdserve_pb2_grpc.InferenceStub(channel).GetStats(pdserve_pb2.GetStatsRequest(),
                                                                timeout=5)


def _worker_load(address: str, role: str, secret: ClusterSecret) -> worker_pb2.WorkerLoad:
    """Asked of the worker itself, with the cluster secret, as a router asks."""
    stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill"
            else worker_pb2_grpc.DecodeWorkerStub)
    with grpc.insecure_channel(address) as channel:
        return stub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5,
                                     metadata=secret.grpc_metadata())


def _used_blocks(service, secret: ClusterSecret) -> dict[str, int]:
    return {c.worker_id: _worker_load(c.address, c.role, secret).num_used_blocks
            for c in service.router.workers()}


@pytest.mark.parametrize("flags, says", [
    (["--redis-namespace", "no-such-deployment"], "no pdserve deployment publishes its workers"),
    (["--block-size", "32"], "block_size is 32, the deployment's is 16"),
])
def test_a_router_that_cannot_join_fails_fast(service, ray_cluster, model_dir, flags, says):
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--router-only", "--ray-address",
            ray_cluster.address, "--model", str(model_dir), "--port", "0",
            "--metrics-port", "0", "--http-port", "0", *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=START_S,
                          env={**os.environ, "PDSERVE_REDIS_PASSWORD": REDIS_PASSWORD})
    assert done.returncode == 2 and says in done.stderr, done.stderr[-2000:]
    assert "pdserve is serving" not in done.stdout


def test_both_routers_serve_the_offline_greedy_tokens(service, second, offline):
    prompts = token_prompts(12, seed=1)
    expected = offline_greedy(offline, prompts, 24)

    async def run():
        return await asyncio.gather(*(
            _stream(service.address if i % 2 else second.address, f"both-{i}", p, 24)
            for i, p in enumerate(prompts)))

    assert asyncio.run(run()) == [("length", tokens) for tokens in expected]
    # the second router knows every worker of the pool (from the registry), each up
    owner = {c.worker_id for c in service.router.workers()}
    workers = _router_stats(second.address).workers
    assert {w.worker_id for w in workers} == owner and all(w.up for w in workers)


def test_a_session_continues_on_the_other_router(service, second):
    """Turn 2 on the second router finds turn 1's decode worker through Redis: its prompt and
    reply come from that worker's cache (a prefill worker holds the prompt at most)."""
    sampling = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    turn1 = token_prompts(1, seed=7)[0]
    with Client(service.address, timeout=120) as owner, \
            Client(second.address, timeout=120) as other:
        first = owner.complete(turn1, session_id="s-across", sampling=sampling)
        turn2 = turn1 + list(first.token_ids) + [11, 12, 13]
        again = other.complete(turn2, session_id="s-across", sampling=sampling)
    history = len(turn1) + len(first.token_ids)
    assert again.usage.cached_tokens >= history - 2 * 16 - 2 > len(turn1)


def test_a_restarted_worker_rejoins_the_second_router(service, second, secret):
    old = service.router.decode["decode-0"].address
    (pid,) = service.service.pool.pids("decode-0")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: (c := service.router.decode["decode-0"]).address != old and c.up,
               START_S, "the supervisor restarts decode-0 (at another port)")

    # up again in the second router: only a client to the new address can be (the old port is
    # dead), and only the registry tells it that address
    def rejoined() -> bool:
        return {w.worker_id: w.up for w in _router_stats(second.address).workers}["decode-0"]
    wait_until(rejoined, 10, "the second router registers decode-0 at its new address")
    # and places on both decode workers again: seen running on each, asked of the workers
    decode = {wid: c.address for wid, c in service.router.decode.items()}
    seen = dict.fromkeys(decode, 0)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for wid, address in decode.items():
                seen[wid] = max(seen[wid], _worker_load(address, "decode", secret).num_running)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    async def run():
        return await asyncio.gather(*(_stream(second.address, f"rejoin-{i}", p, 256)
                                      for i, p in enumerate(token_prompts(8, seed=3))))
    try:
        results = asyncio.run(run())
    finally:
        done.set()
        watcher.join(10)
    assert [reason for reason, _ in results] == ["length"] * 8
    assert all(n > 0 for n in seen.values()), seen


def test_killing_the_second_router_frees_its_requests_and_spares_the_owners(
        service, second, offline, secret):
    prompts = token_prompts(6, seed=2)
    expected = offline_greedy(offline, prompts[:3], 48)

    async def run():
        started = [asyncio.Event() for _ in prompts]
        tasks = [asyncio.create_task(_stream(
            service.address if i < 3 else second.address, f"kill-{i}", p,
            48 if i < 3 else ORPHAN_TOKENS, started[i])) for i, p in enumerate(prompts)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        assert not any(t.done() for t in tasks[3:]), "a long stream ended before the kill"
        second.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        return await asyncio.wait_for(asyncio.gather(*tasks), 120), killed

    results, killed = asyncio.run(run())
    assert results[:3] == [("length", tokens) for tokens in expected]
    for reason, tokens in results[3:]:  # its streams fail, far from their end
        assert reason != "length" and len(tokens) < ORPHAN_TOKENS
    wait_until(lambda: not any(_used_blocks(service, secret).values()),
               max(0.1, killed + LEASE_S - time.monotonic()),
               f"every worker holds no blocks within {LEASE_S} s of the kill")
