"""A synthetic decode worker (no model) for measuring the router alone.

A real, cluster-authenticated gRPC `DecodeWorker` server (pdserve.worker_grpc.worker_server)
whose "engine" is a clock: every `step_ms` it emits one StepOutputs carrying one new token for
every running request (finish_reason "length" at max_tokens), as a real decode worker does per
engine step. Reserve / Submit grant at once, GetLoad reports plenty of free blocks, and an idle
`Outputs` stream sends its keepalive every KEEPALIVE_S. As on a real decode worker, a request's
tokens go only to its owner's `Outputs` stream (the router_id of its Reserve / Submit, and of
the Outputs request), so several routers can share the worker; a newer stream of one router
ends its older one. A step with no news for a router sends that router nothing, and steps a
router has not read yet go out merged into one message (decode_worker.coalesce), as a real
worker's do.

Emit times travel out of band. Step s carries the token `token_ids[s % len(token_ids)]`, a
word token (" the", " of", ...), so a client can tell from a token id (gRPC) or from a word of
the text (HTTP) which step produced it; the worker records `time.monotonic()` for each step as
its clock makes it (CLOCK_MONOTONIC is one clock for every process on a Linux machine; a
router that falls behind shows as added latency), and `StepTokens.added_latency` turns
(receive time, token index) pairs into receive - emit. The clock never bursts to catch up:
a late step is just late.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np

from pdserve.cluster_secret import ClusterSecret
from pdserve.decode_worker.coalesce import coalesce
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.worker_grpc import bind, worker_server

KEEPALIVE_S = 1.0
RPC_THREADS = 64
WORD = re.compile(r"Ġ[a-z]+")  # byte-level BPE: "Ġ" is the leading space
MANY = 1 << 24  # blocks / sequences the worker reports room for
START_TIMEOUT_S = 120.0


class StepTokens:
    """Which token step s carries, and back: from a token id (gRPC) or a word (HTTP text)."""

    def __init__(self, tokenizer) -> None:
        # a space and lowercase letters: each decodes on its own, and a streamed text splits
        # back into them word by word
        vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.token_ids = [i for i, tok in enumerate(vocab) if tok and WORD.fullmatch(tok)]
        self.by_id = {t: i for i, t in enumerate(self.token_ids)}
        self.by_word = {vocab[t][1:]: i for i, t in enumerate(self.token_ids)}

    def added_latency(self, recv_times: np.ndarray, token_index: np.ndarray,
                      step_times: np.ndarray) -> np.ndarray:
        """Receive time minus emit time per token, in seconds. A token index names its step
        modulo len(token_ids): the latest such step emitted before the token arrived."""
        last = np.searchsorted(step_times, recv_times, side="right") - 1
        step = last - np.mod(last - token_index, len(self.token_ids))
        if step.size and step.min() < 0:
            raise ValueError("a token arrived before the step that carries it was emitted")
        return recv_times - step_times[step]


class SyntheticDecode(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, token_ids: Sequence[int], step_s: float,
                 worker_id: str = "decode-0") -> None:
        if step_s <= 0 or not token_ids:
            raise ValueError("step_s must be > 0 and token_ids non-empty")
        self.token_ids, self.step_s, self.worker_id = list(token_ids), step_s, worker_id
        self.step_times: list[float] = []  # monotonic emit time of step s, s = index
        self._running: dict[str, int] = {}  # request id -> tokens still to emit
        self._owners: dict[str, str] = {}  # request id -> router id
        self._lock = threading.Lock()
        self._subscribers: dict[str, queue.SimpleQueue] = {}  # router id -> its stream's steps

    def Reserve(self, request, context):
        self._add(request.request_id, request.sampling, request.router_id)
        return worker_pb2.ReserveResponse(granted=True, descriptor=b"{}")

    def Start(self, request, context):
        return worker_pb2.StartResponse()

    def Submit(self, request, context):
        self._add(request.request_id, request.sampling, request.router_id)
        return worker_pb2.SubmitResponse(granted=True)

    def _add(self, request_id: str, sampling, router_id: str) -> None:
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16
        with self._lock:
            self._running[request_id] = max(max_tokens, 1)
            self._owners[request_id] = router_id

    def Abort(self, request, context):
        with self._lock:
            found = self._running.pop(request.request_id, None) is not None
            self._owners.pop(request.request_id, None)
        return worker_pb2.WorkerAbortResponse(found=found)

    def GetLoad(self, request, context):
        return worker_pb2.WorkerLoad(
            worker_id=self.worker_id, num_blocks=MANY, num_free_blocks=MANY,
            num_running=len(self._running), max_num_seqs=MANY, block_size=16, tp_size=1)

    def Outputs(self, request, context):
        steps: queue.SimpleQueue = queue.SimpleQueue()  # a None ends the stream (replaced)
        router_id = request.router_id
        with self._lock:
            old = self._subscribers.get(router_id)
            if old is not None:
                old.put(None)
            self._subscribers[router_id] = steps
        try:
            yield worker_pb2.StepOutputs()  # the router puts the worker in rotation after it
            while context.is_active():
                try:
                    waiting = [steps.get(timeout=KEEPALIVE_S)]
                except queue.Empty:
                    waiting = [worker_pb2.StepOutputs()]
                while waiting[-1] is not None and not steps.empty():
                    waiting.append(steps.get())  # fell behind: merged, as a real worker does
                if waiting[-1] is None:
                    return
                yield coalesce(waiting)
        finally:
            with self._lock:
                if self._subscribers.get(router_id) is steps:
                    del self._subscribers[router_id]

    def run(self, stop: threading.Event) -> None:
        """The engine loop: one step every step_s while anything runs."""
        next_at = time.monotonic()
        while not stop.is_set():
            next_at += self.step_s
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                next_at = time.monotonic()  # behind: no burst of catch-up steps
            self.step()

    def step(self) -> None:
        with self._lock:
            if not self._running:
                return
            token = self.token_ids[len(self.step_times) % len(self.token_ids)]
            by_router: dict[str, list[worker_pb2.RequestDelta]] = {}
            for rid, left in list(self._running.items()):
                done = left == 1
                by_router.setdefault(self._owners[rid], []).append(worker_pb2.RequestDelta(
                    request_id=rid, token_ids=[token], finish_reason="length" if done else ""))
                if done:
                    del self._running[rid], self._owners[rid]
                else:
                    self._running[rid] = left - 1
            sends = [(self._subscribers.get(router_id), worker_pb2.StepOutputs(deltas=deltas))
                     for router_id, deltas in by_router.items()]
            self.step_times.append(time.monotonic())
        for steps, message in sends:
            if steps is not None:  # its owner has no stream now: dropped, as a real worker does
                steps.put(message)


def serve(conn: Connection, secret: ClusterSecret, token_ids: list[int], step_ms: float) -> None:
    """Process entry: serve until told "stop"; answers "steps" with every step's emit time.
    Speaks JSON over `conn` (a local pipe to the benchmark)."""
    logging.basicConfig(level=logging.WARNING)
    worker = SyntheticDecode(token_ids, step_ms / 1000)
    server = worker_server(secret, RPC_THREADS, "synthetic-decode")
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(worker, server)
    port = bind(server, "127.0.0.1", None)
    server.start()
    stop = threading.Event()
    clock = threading.Thread(target=worker.run, args=(stop,), name="engine", daemon=True)
    clock.start()
    conn.send_bytes(json.dumps({"address": f"127.0.0.1:{port}", "pid": os.getpid()}).encode())
    try:
        while (command := conn.recv_bytes().decode()) != "stop":
            if command == "steps":
                conn.send_bytes(json.dumps(list(worker.step_times)).encode())
    finally:
        stop.set()
        clock.join()
        server.stop(grace=0).wait()


@dataclass
class Child:
    """A benchmark process (this worker, or a router under test) and its local pipe, on which
    it answers commands with JSON; its first message says where it serves and its pid."""

    process: multiprocessing.Process
    conn: Connection
    info: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.info["pid"]

    def ask(self, command: str) -> object:
        self.conn.send_bytes(command.encode())
        return json.loads(self.conn.recv_bytes())

    def stop(self) -> object | None:
        """Ask it to stop; its last answer (a router's profile), or None."""
        answer = None
        try:
            self.conn.send_bytes(b"stop")
            if self.conn.poll(30):
                answer = json.loads(self.conn.recv_bytes())
        except (OSError, EOFError):
            pass
        self.process.join(30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        return answer


def spawn(target, *args) -> Child:
    """`target(conn, *args)` in a fresh (spawned) process, once it has said it is serving."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = Child(ctx.Process(target=target, args=(theirs, *args), daemon=True), ours)
    child.process.start()
    try:
        if not ours.poll(START_TIMEOUT_S):
            raise TimeoutError(f"{target.__name__} did not start in {START_TIMEOUT_S:g} s")
        child.info = json.loads(ours.recv_bytes())
    except BaseException:
        child.stop()
        raise
    return child


def start_worker(secret: ClusterSecret, token_ids: list[int], step_ms: float) -> Child:
    return spawn(serve, secret, token_ids, step_ms)
