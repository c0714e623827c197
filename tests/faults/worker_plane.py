"""Real worker gRPC services for tests/faults/test_worker_plane.py, started in this process.

A prefill worker and a TP-1 decode worker run in-process behind their real, authenticated
gRPC servers and KV channels (gloo over TCPStore on 127.0.0.1). A TP-2 decode group runs
rank 0 here and rank 1 as a process (tests.workers.host), so a test can SIGSTOP or SIGKILL
the follower. `OutputsReader` records a decode worker's Outputs stream with arrival times.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import grpc
import torch.distributed as dist

from pdserve.cluster_secret import ClusterSecret
from pdserve.decode_worker.actor import pull_transport, tp_group
from pdserve.decode_worker.group import start_decode_rank
from pdserve.decode_worker.service import DecodeService
from pdserve.engine.models.parallel import TensorParallel
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.rendezvous import GlooListener
from pdserve.prefill_worker.service import PrefillService
from pdserve.proto import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker_spec import WorkerSpec
from tests.workers.pd import MODEL_NAME
from tests.workers.processes import Host, free_port

NUM_BLOCKS = 64
SECRET = ClusterSecret.generate()  # the worker plane's, for every test of the module
AUTH = SECRET.grpc_metadata()
PROMPT = list(range(20, 60))


def worker_spec(model_dir, worker_id: str, **limits) -> WorkerSpec:
    """The same engine as tests.workers.pd.engine_config (so a follower process matches)."""
    return WorkerSpec(worker_id=worker_id, model=str(model_dir), model_name=MODEL_NAME,
                      max_model_len=512, num_kv_blocks=NUM_BLOCKS, max_num_seqs=32,
                      max_num_batched_tokens=512, num_threads=1,
                      lora_config={"max_loras": 2, "max_lora_rank": 16}, **limits)


def start_prefill(spec: WorkerSpec, secret: ClusterSecret) -> PrefillService:
    return PrefillService(spec, secret)


def start_decode(spec: WorkerSpec, secret: ClusterSecret) -> DecodeService:
    """A TP-1 decode worker as its actor builds it, without Ray."""
    listener = GlooListener(spec.host, secret=secret)
    worker = start_decode_rank(spec.engine_config(), TensorParallel(), listener,
                               [listener.endpoint], spec.model_name,
                               max_reservation_s=spec.max_reservation_s, tp_beat_s=spec.tp_beat_s,
                               transport=pull_transport(spec, secret, [listener.endpoint], 1))
    return DecodeService(worker, spec.worker_id, spec.host, secret,
                         stall_timeout_s=spec.stall_timeout_s)


@contextlib.contextmanager
def decode_tp2(spec: WorkerSpec, secret: ClusterSecret) -> Iterator[tuple[DecodeService, Host]]:
    """A TP-2 decode group: (rank 0's service here, the follower's process)."""
    port = free_port()
    follower = Host({"role": "decode", "rank": 1, "tp_size": 2, "tp_port": port,
                     "model_dir": spec.model, "num_blocks": NUM_BLOCKS,
                     "tp_timeout_s": spec.tp_timeout_s})
    service = None
    try:
        store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
        group = tp_group(store, "127.0.0.1", 0, 2, timedelta(seconds=spec.tp_timeout_s))
        listener = GlooListener("127.0.0.1", rank=0, secret=secret)
        store.set("kv_port", str(listener.endpoint.port))
        endpoints = [Endpoint("127.0.0.1", listener.endpoint.port, r) for r in range(2)]
        worker = start_decode_rank(spec.engine_config(), TensorParallel(0, 2, group), listener,
                                   endpoints, spec.model_name,
                                   max_reservation_s=spec.max_reservation_s,
                                   tp_beat_s=spec.tp_beat_s)
        service = DecodeService(worker, spec.worker_id, "127.0.0.1", secret,
                                stall_timeout_s=spec.stall_timeout_s)
        yield service, follower
    finally:
        if service is not None:
            service.stop()
        if follower.proc.poll() is None:
            follower.proc.kill()
        follower.proc.wait(timeout=30)


def decode_stub(address: str) -> tuple[grpc.Channel, worker_pb2_grpc.DecodeWorkerStub]:
    channel = grpc.insecure_channel(address)
    return channel, worker_pb2_grpc.DecodeWorkerStub(channel)


def prefill_stub(address: str) -> tuple[grpc.Channel, worker_pb2_grpc.PrefillWorkerStub]:
    channel = grpc.insecure_channel(address)
    return channel, worker_pb2_grpc.PrefillWorkerStub(channel)


def sampling(max_tokens: int = 4, **fields) -> pdserve_pb2.SamplingParams:
    """Greedy, ignoring EOS (so a request runs exactly max_tokens); `fields` override."""
    return pdserve_pb2.SamplingParams(**({"max_tokens": max_tokens, "temperature": 0,
                                          "ignore_eos": True} | fields))


def source_of(prefill: PrefillService) -> worker_pb2.Endpoint:
    return worker_pb2.Endpoint(host="127.0.0.1", port=prefill.port, rank=0)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds it took; AssertionError naming `what` after `timeout_s`."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not {what} within {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - started


class OutputsReader:
    """One Outputs stream read in a thread: every message with its arrival time, and how the
    stream ended (`code`, None while open). The call's deadline bounds every test."""

    def __init__(self, address: str, metadata, timeout_s: float = 120.0) -> None:
        self.channel, stub = decode_stub(address)
        self.call = stub.Outputs(worker_pb2.OutputsRequest(), metadata=metadata,
                                 timeout=timeout_s)
        self.messages: list[tuple[float, worker_pb2.StepOutputs]] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.ended_at: float | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                self.messages.append((time.monotonic(), message))
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""
        self.ended_at = time.monotonic()

    def keepalives(self, since: float = 0.0) -> list[float]:
        return [t for t, m in list(self.messages) if not m.deltas and t >= since]

    def deltas(self, request_id: str) -> list[tuple[float, worker_pb2.RequestDelta]]:
        return [(t, d) for t, m in list(self.messages) for d in m.deltas
                if d.request_id == request_id]

    def last_delta(self, request_id: str) -> tuple[float, worker_pb2.RequestDelta] | None:
        finished = [(t, d) for t, d in self.deltas(request_id) if d.finish_reason]
        return finished[-1] if finished else None

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(10)
        self.channel.close()


@dataclass
class Plane:
    prefill: PrefillService
    decode: DecodeService
    p: object  # PrefillWorkerStub
    d: object  # DecodeWorkerStub
    reader: OutputsReader  # the one Outputs stream (as the router keeps one per worker)

    @property
    def vocab(self) -> int:
        return self.decode.worker.config.model.vocab_size


def reserve(plane: Plane, rid: str, deadline_s: float = 30.0):
    return plane.d.Reserve(worker_pb2.ReserveRequest(
        request_id=rid, prompt_token_ids=PROMPT, sampling=sampling(),
        sources=[source_of(plane.prefill)], deadline=time.time() + deadline_s),
        metadata=AUTH, timeout=30)


def prefill(plane: Plane, rid: str, descriptor: bytes, prompt=PROMPT, timeout: float = 60):
    return plane.p.Prefill(worker_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=sampling(), descriptor=descriptor),
        metadata=AUTH, timeout=timeout)
