"""WorkerPool on a real two-node Ray cluster (both nodes on 127.0.0.1, in this process tree).

Head node: {"prefill": 1}, 2 CPUs. Second node: {"decode": 2}, 4 logical CPUs, so a TP-1
decode worker and a TP-2 decode group (one CPU per rank) are placed side by side.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import grpc
import pytest

from pdserve.cluster_secret import ClusterSecret
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.sampling_params import SamplingParams
from pdserve.launch.pool import WorkerPool
from pdserve.launch.worker import WorkerInfo
from pdserve.proto import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker_spec import WorkerSpec
from tests.e2e.harness import wait_until
from tests.ray_cluster import local_cluster
from tests.workers.pd import engine_config, run_engine

NUM_BLOCKS = 128
RESTART_DEADLINE_S = 120.0
SECRET = ClusterSecret.generate()  # every pool's; the workers get it through runtime_env
AUTH = SECRET.grpc_metadata()


@pytest.fixture(scope="module")
def ray_cluster():
    with local_cluster([(2, {"prefill": 1}), (4, {"decode": 2})]) as cluster:
        yield cluster


def spec(model_dir, worker_id: str) -> WorkerSpec:
    return WorkerSpec(worker_id=worker_id, model=str(model_dir), model_name="tiny-llama",
                      max_model_len=512, num_kv_blocks=NUM_BLOCKS, num_threads=1)


@pytest.fixture(scope="module")
def pool(ray_cluster, tiny_llama_dir):
    pool = WorkerPool(prefill=[spec(tiny_llama_dir, "prefill-0")],
                      decode=[spec(tiny_llama_dir, "decode-0")], secret=SECRET)
    started = time.monotonic()
    infos = pool.start()
    print(f"pool (1 prefill + 1 decode) up in {time.monotonic() - started:.1f} s")
    assert {i.worker_id for i in infos} == {"prefill-0", "decode-0"}
    yield pool
    pool.shutdown()


def get_load(info: WorkerInfo) -> worker_pb2.WorkerLoad:
    stub_class = (worker_pb2_grpc.PrefillWorkerStub if info.role == "prefill"
                  else worker_pb2_grpc.DecodeWorkerStub)
    with grpc.insecure_channel(info.address) as channel:
        return stub_class(channel).GetLoad(worker_pb2.GetLoadRequest(), metadata=AUTH,
                                           timeout=30)


def generate(prefill: WorkerInfo, decode: WorkerInfo, rid: str, prompt: list[int],
             max_tokens: int) -> list[int]:
    """Greedy tokens of one request served disaggregated over the workers' gRPC services."""
    sampling = pdserve_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    host, port = prefill.address.rsplit(":", 1)
    with grpc.insecure_channel(decode.address) as d_channel, \
            grpc.insecure_channel(prefill.address) as p_channel:
        decode_stub = worker_pb2_grpc.DecodeWorkerStub(d_channel)
        outputs = decode_stub.Outputs(worker_pb2.OutputsRequest(), metadata=AUTH, timeout=120)
        reserved = decode_stub.Reserve(worker_pb2.ReserveRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling,
            sources=[worker_pb2.Endpoint(host=host, port=int(port), rank=0)],
            deadline=time.time() + 60), metadata=AUTH, timeout=30)
        assert reserved.granted
        first = worker_pb2_grpc.PrefillWorkerStub(p_channel).Prefill(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling,
            descriptor=reserved.descriptor), metadata=AUTH, timeout=60)
        decode_stub.Start(worker_pb2.StartRequest(
            request_id=rid, first_token_id=first.first_token_id), metadata=AUTH, timeout=30)
        tokens = []
        for step in outputs:
            for delta in step.deltas:
                if delta.request_id == rid:
                    tokens.extend(delta.token_ids)
                    if delta.finish_reason:
                        assert not delta.error, delta.error
                        outputs.cancel()
                        return tokens
    raise AssertionError(f"{rid}: the output stream ended first")


def by_id(pool: WorkerPool) -> dict[str, WorkerInfo]:
    return {info.worker_id: info for info in pool.infos()}


def node_resources() -> dict[str, dict]:
    import ray

    return {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}


def test_cluster_binds_loopback_only(ray_cluster):
    from pdserve.launch.ray_runtime import node_addresses, unreachable_worker_host

    nodes = node_resources().values()
    assert len(nodes) == 2
    assert {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}
    assert node_addresses() == ["127.0.0.1"] * 2  # what `pdserve up` checks its workers by
    assert unreachable_worker_host("127.0.0.1", node_addresses()) is None  # one machine


def test_pool_places_and_serves_prefill_and_decode(pool):
    infos = by_id(pool)
    nodes = node_resources()
    for wid, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        info = infos[wid]
        assert info.role == role and info.tp_size == 1
        assert info.address.startswith("127.0.0.1:")
        load = get_load(info)
        assert (load.worker_id, load.num_blocks, load.tp_size) == (wid, NUM_BLOCKS, 1)
        assert load.num_free_blocks == NUM_BLOCKS
        [node_id] = pool.node_ids(wid)
        assert role in nodes[node_id]["Resources"], f"{wid} placed on a node without {role}"


def watch_restart(pool: WorkerPool, kill_pid: int) -> tuple[list[str], WorkerInfo, float]:
    """SIGKILL one process and supervise until a worker is back: (downs, its info, seconds)."""

    async def run():
        downs: list[str] = []
        ups: asyncio.Queue[WorkerInfo] = asyncio.Queue()

        async def on_up(info: WorkerInfo) -> None:
            await ups.put(info)

        task = asyncio.create_task(pool.supervise(on_up, downs.append, interval_s=0.2))
        await asyncio.sleep(0.5)  # a round of healthy pings first
        assert downs == [] and not task.done()
        killed = time.monotonic()
        os.kill(kill_pid, signal.SIGKILL)
        try:
            info = await asyncio.wait_for(ups.get(), RESTART_DEADLINE_S)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return downs, info, time.monotonic() - killed

    return asyncio.run(run())


def test_supervision_restarts_a_killed_prefill_worker(pool):
    old = by_id(pool)["prefill-0"]
    [old_pid] = pool.pids("prefill-0")
    downs, info, seconds = watch_restart(pool, old_pid)
    print(f"prefill worker restarted in {seconds:.1f} s")
    assert downs == ["prefill-0"]
    assert info.worker_id == "prefill-0" and info.role == "prefill"
    assert info.address != old.address
    assert by_id(pool)["prefill-0"] == info
    assert get_load(info).worker_id == "prefill-0"
    assert pool.pids("prefill-0") != [old_pid]
    assert get_load(by_id(pool)["decode-0"]).worker_id == "decode-0"  # untouched


def test_decode_tp2_group_in_one_placement_group_restarts_whole(pool, tiny_llama_dir):
    prefill = by_id(pool)["prefill-0"]
    group = WorkerPool(decode=[spec(tiny_llama_dir, "decode-tp2")], decode_tp=2, secret=SECRET)
    started = time.monotonic()
    try:
        [info] = group.start()
        print(f"decode TP-2 group up in {time.monotonic() - started:.1f} s")
        assert info.tp_size == 2
        load = get_load(info)
        assert (load.worker_id, load.tp_size, load.num_blocks) == ("decode-tp2", 2, NUM_BLOCKS)
        node_ids = group.node_ids("decode-tp2")
        assert len(set(node_ids)) == 1
        assert "decode" in node_resources()[node_ids[0]]["Resources"]
        prompt = list(range(3, 60))
        expected = run_engine(EngineCore(engine_config(tiny_llama_dir)), [prompt],
                              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert generate(prefill, info, "tp2-a", prompt, 8) == expected[0]
        old_pids = group.pids("decode-tp2")
        downs, new, seconds = watch_restart(group, old_pids[1])  # a follower dies
        print(f"decode TP-2 group restarted in {seconds:.1f} s")
        assert downs == ["decode-tp2"] and new.address != info.address
        assert get_load(new).tp_size == 2
        assert generate(prefill, new, "tp2-b", prompt, 8) == expected[0]
        assert not set(group.pids("decode-tp2")) & set(old_pids)  # every rank replaced
    finally:
        group.shutdown()


def test_decode_tp2_group_spread_over_two_nodes(pool, tiny_llama_dir):
    """STRICT_SPREAD: rank 0 on the decode node, rank 1 on the other; the group's all-reduces
    cross nodes and its output is the engine's all the same."""
    prefill = by_id(pool)["prefill-0"]
    group = WorkerPool(decode=[spec(tiny_llama_dir, "decode-spread")], decode_tp=2,
                       tp_placement="STRICT_SPREAD", secret=SECRET)
    try:
        [info] = group.start()
        rank0, rank1 = group.node_ids("decode-spread")
        assert rank0 != rank1 and "decode" in node_resources()[rank0]["Resources"]
        prompt = list(range(5, 40))
        expected = run_engine(EngineCore(engine_config(tiny_llama_dir)), [prompt],
                              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert generate(prefill, info, "spread-a", prompt, 8) == expected[0]
    finally:
        group.shutdown()


OWNER = """
import json, sys, threading
from pdserve.cluster_secret import ClusterSecret
from pdserve.launch.pool import WorkerPool
from pdserve.launch.ray_runtime import start_ray
from pdserve.worker_spec import WorkerSpec
address, spec = sys.argv[1], WorkerSpec.from_dict(json.loads(sys.argv[2]))
start_ray(address, {}, None, None)
pool = WorkerPool(decode=[spec], decode_tp=2, deployment="adopt-test",
                  secret=ClusterSecret.from_env())
[info] = pool.start()
print(json.dumps({"address": info.address, "pids": pool.pids(spec.worker_id)}), flush=True)
threading.Event().wait()  # until SIGKILLed: an owner that dies without stopping anything
"""


def named_actors(prefix: str) -> list[str]:
    import ray

    return [n for n in ray.util.list_named_actors() if n.startswith(prefix)]


def test_a_dead_owners_workers_are_adopted(pool, tiny_llama_dir, tmp_path):
    """An owner of deployment "adopt-test" (a process of its own) starts a decode TP-2 group
    and is SIGKILLed: the group's detached actors keep serving. A pool of the same deployment,
    spec and secret adopts them (the same processes, serving greedy output) instead of
    starting new ones; one of other settings, or another secret, kills them and launches its
    own. A pool that shuts down leaves no actor or placement group of the deployment."""
    import ray

    prefill = by_id(pool)["prefill-0"]
    wspec = spec(tiny_llama_dir, "adopt-d")
    env = {**os.environ, "PDSERVE_CLUSTER_SECRET": SECRET.value.decode()}
    owner = subprocess.Popen([sys.executable, "-c", OWNER, ray.get_runtime_context().gcs_address,
                              json.dumps(wspec.to_dict())], env=env, stdout=subprocess.PIPE,
                             text=True)
    try:
        started = json.loads(owner.stdout.readline())
    finally:
        owner.kill()
        owner.wait()
    prompt = list(range(9, 50))
    expected = run_engine(EngineCore(engine_config(tiny_llama_dir)), [prompt],
                          SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    info = WorkerInfo("adopt-d", "decode", started["address"], 2)
    assert generate(prefill, info, "orphaned", prompt, 8) == expected  # served, owner gone

    adopter = WorkerPool(decode=[wspec], decode_tp=2, deployment="adopt-test", secret=SECRET)
    [adopted] = adopter.start()
    assert adopted.address == started["address"]
    assert adopter.pids("adopt-d") == started["pids"]  # no worker restarted
    assert generate(prefill, adopted, "adopted", prompt, 8) == expected
    assert get_load(adopted).num_used_blocks == 0
    adopter._workers.clear()  # forget them without stopping, as a crash would

    other_secret = WorkerPool(decode=[wspec], decode_tp=2, deployment="adopt-test",
                              secret=ClusterSecret.generate())
    try:
        [fresh] = other_secret.start()
        assert fresh.address != started["address"]
        assert not set(other_secret.pids("adopt-d")) & set(started["pids"])
    finally:
        other_secret._workers.clear()  # left running for the next owner: it has our spec

    other_spec = WorkerSpec.from_dict({**wspec.to_dict(), "num_kv_blocks": NUM_BLOCKS // 2})
    last = WorkerPool(decode=[other_spec], decode_tp=2, deployment="adopt-test",
                      secret=SECRET)
    try:
        [relaunched] = last.start()  # the other secret's launch: killed, not adopted
        assert relaunched.address != fresh.address
        assert get_load(relaunched).num_blocks == NUM_BLOCKS // 2
    finally:
        last.shutdown()
    wait_until(lambda: not named_actors("adopt-test/"), 30, "the deployment's actors gone")
    with pytest.raises(ValueError):
        ray.util.get_placement_group("adopt-test/adopt-d")


@pytest.mark.parametrize("kwargs, missing", [
    ({"prefill": 2}, "prefill: needs 2, the cluster has 1"),
    ({"prefill": 1, "gpus": True}, "GPU: needs 1, the cluster has 0"),
    ({"decode": 1, "decode_tp": 3, "num_cpus": 2}, "no room for its TP group of 3 on one node"),
    ({"decode": 1, "decode_tp": 3, "num_cpus": 1, "tp_placement": "STRICT_SPREAD"},
     "no room for its TP group of 3 on 3 nodes, one rank each"),
])
def test_pool_fails_fast_on_missing_resources(ray_cluster, tiny_llama_dir, kwargs, missing):
    kwargs = dict(kwargs)
    prefill = [spec(tiny_llama_dir, f"p{i}") for i in range(kwargs.pop("prefill", 0))]
    decode = [spec(tiny_llama_dir, f"d{i}") for i in range(kwargs.pop("decode", 0))]
    pool = WorkerPool(prefill=prefill, decode=decode, secret=SECRET, **kwargs)
    started = time.monotonic()
    with pytest.raises(ValueError, match=missing):
        pool.start()
    assert time.monotonic() - started < 5


def test_pool_times_out_naming_what_it_waits_for(pool, tiny_llama_dir):
    """The only prefill resource is taken (by `pool`): creation waits, then fails cleanly."""
    waiting = WorkerPool(prefill=[spec(tiny_llama_dir, "p-extra")], start_timeout_s=2,
                         secret=SECRET)
    with pytest.raises(TimeoutError, match=r"p-extra needs \{'CPU': 1, 'prefill': 1\}"):
        waiting.start()
    assert waiting.infos() == [] and by_id(pool)["prefill-0"]


LOCAL_HEAD = """
import json, sys
import ray
from pdserve.launch.ray_runtime import start_ray, stop_ray
start_ray(None, {"prefill": 1, "decode": 1}, 2, sys.argv[1])
seen = {"nodes": [n["NodeManagerAddress"] for n in ray.nodes()],
        "gcs": ray.get_runtime_context().gcs_address, "resources": ray.cluster_resources()}
stop_ray()
print(json.dumps(seen))
"""


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def test_start_ray_local_head_binds_loopback_and_stops_clean():
    tmpdir = tempfile.mkdtemp(prefix="pdray", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_TMPDIR"}  # start_ray sets it
    try:
        done = subprocess.run([sys.executable, "-c", LOCAL_HEAD, tmpdir], capture_output=True,
                              text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        assert seen["nodes"] == ["127.0.0.1"]
        assert seen["gcs"].rsplit(":", 1)[0] == "127.0.0.1"
        assert seen["resources"]["prefill"] == 1 and seen["resources"]["decode"] == 1
        deadline = time.monotonic() + 15
        while processes_mentioning(tmpdir) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_mentioning(tmpdir) == []  # stop_ray left nothing of its head behind
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
