"""Issue 16 on the worker side: an authenticated worker plane that trusts no field, caps what
a caller may hold, answers the status codes the router acts on, and never stalls silently.

Real gRPC servers and gloo KV channels on 127.0.0.1 (prefill + TP-1 decode in this process,
a TP-2 decode group with its follower as a process), and a real Ray cluster for the secret's
delivery through runtime_env.
    finding 1   every RPC of both services needs the cluster secret; Ray-started workers get
                it from runtime_env, never argv
    finding 1b  every bad field -> INVALID_ARGUMENT naming it; the worker keeps serving and
                holds nothing; a reservation deadline is capped at now + max_reservation_s
    finding 10  Start after the reservation expired -> NOT_FOUND; a push the decode side
                refused -> ABORTED (not UNAVAILABLE: the prefill worker is fine)
    finding 11  Outputs keepalives while idle, none while the loop is wedged; a hung or dead
                TP follower fails rank 0's step within the collective timeout, the requests
                end with an error and free their blocks
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve import cluster_secret
from pdserve.cluster_secret import METADATA_KEY, ClusterSecret
from pdserve.decode_worker.service import DecodeService
from pdserve.kvtransfer.descriptor import TransferDescriptor
from pdserve.proto import worker_pb2
from tests.faults.worker_plane import (
    AUTH,
    PROMPT,
    SECRET,
    OutputsReader,
    Plane,
    decode_stub,
    decode_tp2,
    prefill,
    prefill_stub,
    reserve,
    sampling,
    source_of,
    start_decode,
    start_prefill,
    wait_until,
    worker_spec,
)
from tests.faults.worker_plane_cases import BAD_FIELDS

MAX_RESERVATION_S = 5.0
KEEPALIVE_S = 1.0
SLACK_S = 10.0  # 2 shared cores: scheduling, a gloo error surfacing, a stream closing
_SERIAL = itertools.count()


@pytest.fixture(scope="module")
def plane(tiny_llama_dir):
    prefill = start_prefill(worker_spec(tiny_llama_dir, "prefill-t"), SECRET)
    decode = start_decode(worker_spec(tiny_llama_dir, "decode-t",
                                      max_reservation_s=MAX_RESERVATION_S), SECRET)
    p_channel, p = prefill_stub(prefill.address)
    d_channel, d = decode_stub(decode.address)
    reader = OutputsReader(decode.address, AUTH, timeout_s=1800)
    yield Plane(prefill, decode, p, d, reader)
    reader.close()
    p_channel.close()
    d_channel.close()
    prefill.stop()
    decode.stop()


def serve_one(plane: Plane, rid: str, max_tokens: int = 4) -> list[int]:
    """One request end to end over both services (the router's calls); its token ids."""
    reader, rid = plane.reader, f"{rid}-{next(_SERIAL)}"  # ids unique per attempt
    granted = reserve(plane, rid)
    assert granted.granted
    first = prefill(plane, rid, granted.descriptor)
    plane.d.Start(worker_pb2.StartRequest(request_id=rid, first_token_id=first.first_token_id),
                  metadata=AUTH, timeout=30)
    wait_until(lambda: reader.last_delta(rid) is not None, 60, f"{rid} finished")
    _, last = reader.last_delta(rid)
    assert last.finish_reason == "length", last
    return [t for _, d in reader.deltas(rid) for t in d.token_ids]


def used_blocks(plane: Plane) -> tuple[int, int]:
    loads = [stub.GetLoad(worker_pb2.GetLoadRequest(), metadata=AUTH, timeout=30)
             for stub in (plane.p, plane.d)]
    return tuple(load.num_used_blocks for load in loads)


def assert_serving_and_idle(plane: Plane, rid: str) -> None:
    """The next valid request is served in full, and afterwards neither worker holds a block."""
    assert len(serve_one(plane, rid)) == 4
    wait_until(lambda: used_blocks(plane) == (0, 0), 10, "every block free")


def rpc_code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details() or ""


# ---- finding 1: authentication ----

NO_AUTH = {"none": None, "wrong-secret": ClusterSecret.generate().grpc_metadata(),
           "garbage": ((METADATA_KEY, "not-a-token"),)}


def unauthenticated_calls(plane: Plane):
    """Every RPC of both services with a valid body: each would act if it got through."""
    rid, ok = "intruder", worker_pb2
    return {
        "decode.Reserve": (plane.d.Reserve, ok.ReserveRequest(
            request_id=rid, prompt_token_ids=PROMPT, sampling=sampling(),
            sources=[source_of(plane.prefill)], deadline=time.time() + 30)),
        "decode.Start": (plane.d.Start, ok.StartRequest(request_id=rid, first_token_id=1)),
        "decode.Submit": (plane.d.Submit, ok.SubmitRequest(
            request_id=rid, prompt_token_ids=PROMPT, sampling=sampling())),
        "decode.Abort": (plane.d.Abort, ok.WorkerAbortRequest(request_id=rid)),
        "decode.GetLoad": (plane.d.GetLoad, ok.GetLoadRequest()),
        "prefill.Prefill": (plane.p.Prefill, ok.PrefillRequest(
            request_id=rid, prompt_token_ids=PROMPT, sampling=sampling(), descriptor=b"{}")),
        "prefill.Abort": (plane.p.Abort, ok.WorkerAbortRequest(request_id=rid)),
        "prefill.GetLoad": (plane.p.GetLoad, ok.GetLoadRequest()),
    }


@pytest.mark.parametrize("metadata", NO_AUTH.values(), ids=NO_AUTH.keys())
def test_every_worker_rpc_needs_the_cluster_secret(plane, metadata):
    computed = plane.decode.worker.stats().num_computed_tokens
    for name, (method, request) in unauthenticated_calls(plane).items():
        code, _ = rpc_code(lambda m=method, r=request: m(r, metadata=metadata, timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED, name
    stream = plane.d.Outputs(worker_pb2.OutputsRequest(), metadata=metadata, timeout=10)
    code, _ = rpc_code(lambda: next(stream))
    assert code == grpc.StatusCode.UNAUTHENTICATED, "decode.Outputs"
    # nothing got through: no reservation, no local prefill, no blocks
    assert plane.decode.worker.stats().num_computed_tokens == computed
    assert used_blocks(plane) == (0, 0)
    assert_serving_and_idle(plane, "after-intruder")  # the same calls with the secret work


# ---- finding 1b: every field validated; the worker keeps serving ----

@pytest.mark.parametrize("case", BAD_FIELDS, ids=BAD_FIELDS.keys())
def test_a_bad_field_is_invalid_argument_and_the_worker_keeps_serving(plane, case):
    call, field = BAD_FIELDS[case]
    try:
        code, details = rpc_code(lambda: call(plane))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert field in details, details
    finally:
        for rid in ("bad", "bad-other"):  # a case's own valid reservation, if it made one
            plane.d.Abort(worker_pb2.WorkerAbortRequest(request_id=rid), metadata=AUTH,
                          timeout=30)
    assert plane.decode.worker.is_alive() and plane.prefill.worker.is_alive()
    assert_serving_and_idle(plane, f"after-{case}")


def test_a_duplicate_in_flight_prefill_is_invalid_argument(plane):
    """Two Prefills of one request_id reach the loop together (held between two steps, to
    isolate the race): one is served, the other is INVALID_ARGUMENT, and the loop goes on."""
    granted = reserve(plane, "dup")
    gate = threading.Event()
    loop = plane.prefill.worker._loop
    loop.submit(gate.wait)
    with ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(prefill, plane, "dup", granted.descriptor) for _ in range(2)]
        try:
            wait_until(lambda: loop._queue.qsize() >= 2, 30, "both prefills queued")
        finally:
            gate.set()
        outcomes = []
        for call in calls:
            try:
                outcomes.append(call.result(60).first_token_id)
            except grpc.RpcError as exc:
                outcomes.append((exc.code(), exc.details()))
    errors = [o for o in outcomes if isinstance(o, tuple)]
    assert len(errors) == 1, outcomes
    assert errors[0][0] == grpc.StatusCode.INVALID_ARGUMENT and "in flight" in errors[0][1]
    [first] = [o for o in outcomes if not isinstance(o, tuple)]
    plane.d.Start(worker_pb2.StartRequest(request_id="dup", first_token_id=first),
                  metadata=AUTH, timeout=30)
    assert_serving_and_idle(plane, "after-dup")


def test_a_reservation_deadline_is_capped(plane):
    granted = reserve(plane, "greedy-holder", deadline_s=1e6)
    assert granted.granted
    deadline = TransferDescriptor.decode(granted.descriptor).deadline
    assert deadline <= time.time() + MAX_RESERVATION_S + 0.5, deadline - time.time()
    assert used_blocks(plane)[1] > 0
    wait_until(lambda: used_blocks(plane) == (0, 0), MAX_RESERVATION_S + SLACK_S,
               "the capped reservation reclaimed")


# ---- finding 10: status codes the router acts on ----

def test_start_without_a_live_reservation_is_not_found(plane):
    code, details = rpc_code(lambda: plane.d.Start(worker_pb2.StartRequest(
        request_id="never-reserved", first_token_id=1), metadata=AUTH, timeout=30))
    assert code == grpc.StatusCode.NOT_FOUND, details
    assert reserve(plane, "expires", deadline_s=1.0).granted
    time.sleep(1.5)
    code, details = rpc_code(lambda: plane.d.Start(worker_pb2.StartRequest(
        request_id="expires", first_token_id=1), metadata=AUTH, timeout=30))
    assert code == grpc.StatusCode.NOT_FOUND, details
    wait_until(lambda: used_blocks(plane) == (0, 0), SLACK_S, "the expired reservation freed")
    assert_serving_and_idle(plane, "after-expiry")


def test_a_push_to_a_gone_decode_worker_is_aborted_not_unavailable(plane, tiny_llama_dir):
    """The decode side vanished after reserving: the prefill worker is fine, so the router
    must not take it for down (ABORTED, not UNAVAILABLE)."""
    gone = start_decode(worker_spec(tiny_llama_dir, "decode-gone"), SECRET)
    channel, stub = decode_stub(gone.address)
    with channel:
        granted = stub.Reserve(worker_pb2.ReserveRequest(
            request_id="orphan", prompt_token_ids=PROMPT, sampling=sampling(),
            sources=[source_of(plane.prefill)], deadline=time.time() + 55),
            metadata=AUTH, timeout=30)
    assert granted.granted
    gone.stop()  # the push now fails to connect (within its connect timeouts)
    code, details = rpc_code(lambda: prefill(plane, "orphan", granted.descriptor))
    assert code == grpc.StatusCode.ABORTED, (code, details)
    assert plane.prefill.worker.is_alive()
    assert_serving_and_idle(plane, "after-orphan")


# ---- finding 11: keepalives, a bounded TP collective ----

def test_an_idle_outputs_stream_gets_keepalives(plane):
    reader, since = plane.reader, time.monotonic()
    wait_until(lambda: len(reader.keepalives(since)) >= 3, 3 * KEEPALIVE_S + SLACK_S,
               "3 keepalives")
    beats = [since, *reader.keepalives(since)]
    gaps = [b - a for a, b in zip(beats, beats[1:])]
    assert max(gaps) < KEEPALIVE_S + 1.0, gaps
    assert reader.code is None  # still open


def submit(service: DecodeService, rid: str, max_tokens: int) -> bool:
    channel, stub = decode_stub(service.address)
    with channel:
        return stub.Submit(worker_pb2.SubmitRequest(
            request_id=rid, prompt_token_ids=PROMPT, sampling=sampling(max_tokens)),
            metadata=AUTH, timeout=30).granted


TP_TIMEOUT_S = 6.0  # > MAX_RESERVATION_S, as WorkerSpec requires
STALL_TIMEOUT_S = 2.0


@pytest.mark.parametrize("fault", ["sigstop", "sigkill"])
def test_a_hung_or_dead_tp_follower_fails_the_step_within_the_bound(tiny_llama_dir, fault):
    spec = worker_spec(tiny_llama_dir, f"decode-tp2-{fault}", max_reservation_s=MAX_RESERVATION_S,
                       tp_timeout_s=TP_TIMEOUT_S, stall_timeout_s=STALL_TIMEOUT_S)
    with decode_tp2(spec, SECRET) as (service, follower):
        reader = OutputsReader(service.address, AUTH, timeout_s=120)
        try:
            if fault == "sigstop":  # a following group outlives its collective timeout idle
                for rid in ("warm", "after-idle"):
                    assert submit(service, rid, 8)
                    wait_until(lambda r=rid: reader.last_delta(r) is not None, SLACK_S,
                               f"{rid} finished")
                    assert reader.last_delta(rid)[1].finish_reason == "length", rid
                    if rid == "warm":  # the follower ran its plans: it is following now
                        time.sleep(TP_TIMEOUT_S + 2)
            os.kill(follower.proc.pid, signal.SIGSTOP)
            assert submit(service, "stuck", 400)  # its first step waits on the follower
            wedged = time.monotonic()
            if fault == "sigkill":
                time.sleep(1.0)
                follower.proc.kill()
            bound = (TP_TIMEOUT_S if fault == "sigstop" else 1.0) + SLACK_S
            wait_until(lambda: reader.last_delta("stuck") is not None, bound, "stuck ended")
            ended, last = reader.last_delta("stuck")
            assert last.finish_reason == "error" and last.error, last
            print(f"{fault}: the step failed {ended - wedged:.1f} s after the wedge")
            if fault == "sigstop":  # no keepalive while the loop was wedged past the limit
                assert ended - wedged >= TP_TIMEOUT_S - 1.0
                assert reader.keepalives(since=wedged + STALL_TIMEOUT_S + 1.5) == []
            wait_until(lambda: reader.code is not None, SLACK_S, "the stream closed")
            assert reader.code == grpc.StatusCode.UNAVAILABLE, reader.code
            stats = service.worker.stats()
            assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0, stats
            channel, stub = decode_stub(service.address)
            with channel:
                code, _ = rpc_code(lambda: stub.GetLoad(worker_pb2.GetLoadRequest(),
                                                        metadata=AUTH, timeout=10))
            assert code == grpc.StatusCode.UNAVAILABLE
        finally:
            reader.close()
            if follower.proc.poll() is None:
                os.kill(follower.proc.pid, signal.SIGCONT)


# ---- finding 1: the secret reaches Ray-started workers through runtime_env ----

@pytest.fixture(scope="module", autouse=True)
def launcher_without_secret():
    """This process (the launcher, and so the raylets it starts) holds no secret in its
    environment: a worker can only have it from its runtime_env."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(cluster_secret.ENV, raising=False)
        mp.delenv(cluster_secret.ENV_FILE, raising=False)
        yield


def test_ray_workers_get_the_secret_from_runtime_env_not_argv(ray_cluster, tiny_llama_dir):
    from pdserve.launch.pool import WorkerPool

    assert cluster_secret.ENV not in os.environ
    pool = WorkerPool(prefill=[worker_spec(tiny_llama_dir, "prefill-ray")],
                      decode=[worker_spec(tiny_llama_dir, "decode-ray")], secret=SECRET)
    try:
        infos = {info.worker_id: info for info in pool.start()}
        secret_text = SECRET.value.decode()
        for wid, info in infos.items():
            make = prefill_stub if info.role == "prefill" else decode_stub
            channel, stub = make(info.address)
            with channel:
                assert stub.GetLoad(worker_pb2.GetLoadRequest(), metadata=AUTH,
                                    timeout=30).worker_id == wid
                code, _ = rpc_code(lambda s=stub: s.GetLoad(worker_pb2.GetLoadRequest(),
                                                            timeout=30))
                assert code == grpc.StatusCode.UNAUTHENTICATED
            [pid] = pool.pids(wid)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert secret_text.encode() not in f.read(), f"{wid}: the secret is in argv"
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert f"{cluster_secret.ENV}={secret_text}".encode() in f.read().split(b"\0")
    finally:
        pool.shutdown()
