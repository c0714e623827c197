"""Scriptable worker gRPC servers for tests that isolate the router's reactions.

Real gRPC servers on 127.0.0.1 (port 0), speaking proto/worker.proto and checking the cluster
secret like the real workers do, whose answers a test scripts: a Start that finds no
reservation, a Prefill the decode side failed, a GetLoad that answers late, an `Outputs`
stream that falls silent. The router under test is the real `Router`, driven in-process.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc

from pdserve.cluster_secret import ClusterAuthInterceptor, ClusterSecret
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.descriptor import MAX_REQUEST_ID_CHARS
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.router import Router
from pdserve.router.validation import ModelContext, ValidRequest
from pdserve.worker_grpc import SERVER_OPTIONS

TOKENS = (11, 12, 13, 14)  # what every fake request generates (first token from prefill)
KEEPALIVE_S = 0.3


def load(worker_id: str) -> worker_pb2.WorkerLoad:
    # room for a prompt of a few million tokens (the size-limit tests send one)
    return worker_pb2.WorkerLoad(worker_id=worker_id, num_blocks=1 << 20,
                                 num_free_blocks=1 << 20, max_num_seqs=32, block_size=16,
                                 tp_size=1)


class FakeDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Grants every reservation; a started request streams TOKENS[1:] then "length"."""

    def __init__(self, worker_id: str = "decode-0") -> None:
        self.worker_id = worker_id
        self.start_not_found = 0  # this many Starts answer NOT_FOUND
        self.load_delay_s = 0.0  # GetLoad sleeps this long first
        self.silent = threading.Event()  # set: Outputs sends nothing more (a wedged loop)
        self.reserved: list[str] = []  # worker-side request ids, in arrival order
        self.aborted: list[str] = []
        self.loads_answered = 0
        self._out: queue.Queue = queue.Queue()

    def Reserve(self, request, context):
        self.reserved.append(request.request_id)
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:  # as a real descriptor refuses it
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters")
        return worker_pb2.ReserveResponse(granted=True, descriptor=b"{}")

    def Start(self, request, context):
        if self.start_not_found > 0:
            self.start_not_found -= 1
            context.abort(grpc.StatusCode.NOT_FOUND, f"no reservation {request.request_id}")
        self._run(request.request_id, (request.first_token_id, *TOKENS[1:]))
        return worker_pb2.StartResponse()

    def Submit(self, request, context):
        self._run(request.request_id, TOKENS)
        return worker_pb2.SubmitResponse(granted=True)

    def _run(self, rid: str, tokens: tuple[int, ...]) -> None:
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            self._out.put(worker_pb2.RequestDelta(request_id=rid, token_ids=[token],
                                                  finish_reason="length" if last else ""))

    def Outputs(self, request, context):
        context.send_initial_metadata(())
        while context.is_active():
            if self.silent.is_set():
                time.sleep(0.05)
                continue
            try:
                deltas = [self._out.get(timeout=KEEPALIVE_S)]
            except queue.Empty:
                deltas = []
            yield worker_pb2.StepOutputs(deltas=deltas)

    def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return worker_pb2.WorkerAbortResponse(found=True)

    def GetLoad(self, request, context):
        time.sleep(self.load_delay_s)
        self.loads_answered += 1
        return load(self.worker_id)


class FakePrefill(worker_pb2_grpc.PrefillWorkerServicer):
    """Answers TOKENS[0], or fails with the next code of `failures` while there is one; while
    `hang` is set, a Prefill never answers (a stopped process: only the caller can end it)."""

    def __init__(self, worker_id: str = "prefill-0") -> None:
        self.worker_id = worker_id
        self.failures: list[grpc.StatusCode] = []
        self.requests: list[str] = []
        self.hang = threading.Event()

    def Prefill(self, request, context):
        self.requests.append(request.request_id)
        while self.hang.is_set() and context.is_active():
            time.sleep(0.01)
        if self.failures:
            context.abort(self.failures.pop(0), "scripted failure")
        return worker_pb2.PrefillResponse(first_token_id=TOKENS[0])

    def Abort(self, request, context):
        return worker_pb2.WorkerAbortResponse(found=True)

    def GetLoad(self, request, context):
        return load(self.worker_id)


@contextmanager
def serving(servicer, secret: ClusterSecret, options=SERVER_OPTIONS) -> Iterator[str]:
    """`servicer` on a real, authenticated gRPC server; yields its address."""
    server = grpc.server(futures.ThreadPoolExecutor(16), options=list(options),
                         interceptors=[ClusterAuthInterceptor(secret)])
    if isinstance(servicer, FakeDecode):
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    else:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        servicer_silence = getattr(servicer, "silent", None)
        if servicer_silence is not None:
            servicer_silence.clear()
        server.stop(grace=0).wait()


def make_router(model: ModelContext, secret: ClusterSecret, **config) -> Router:
    return Router(model, RouterConfig(**config), RouterMetrics(), secret=secret)


def request(request_id: str = "req-1", prompt: tuple[int, ...] = (1, 2, 3),
            max_tokens: int = len(TOKENS)) -> ValidRequest:
    return ValidRequest(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                           ignore_eos=True), "")


async def collect(router: Router, req: ValidRequest) -> list:
    """Every message of one request through the router's own generate()."""
    return [m async for m in router.generate(req, time.monotonic())]
