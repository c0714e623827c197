"""A Prefill call that ends (cancelled, its deadline hit) before the servicer registers its
abort callback: grpc then never runs the callback (`add_callback` returns False), so the
servicer aborts the queued prefill itself, at once, instead of leaving it to the KV deadline."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future

from pdserve.prefill_worker import service
from pdserve.prefill_worker.service import PrefillServicer
from pdserve.proto import worker_pb2


class Worker:
    def __init__(self) -> None:
        self.aborted = threading.Event()

    def prefill(self, *args) -> Future:
        return Future()  # queued, never done here

    def abort(self, request_id: str) -> None:
        self.aborted.set()


class EndedCall:
    """A servicer context whose RPC has already terminated."""

    def add_callback(self, callback) -> bool:
        return False

    def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")


class Descriptor:
    deadline = time.time() + 30


def test_an_ended_call_aborts_its_prefill_at_once(monkeypatch) -> None:
    monkeypatch.setattr(service.TransferDescriptor, "decode", staticmethod(lambda b: Descriptor))
    monkeypatch.setattr(service, "sampling_from_proto", lambda *a, **k: None)
    worker = Worker()
    servicer = PrefillServicer(worker, "prefill-0", max_wait_s=3.0)
    request = worker_pb2.PrefillRequest(request_id="gone", prompt_token_ids=[1, 2, 3])
    thread = threading.Thread(target=lambda: _call(servicer, request), daemon=True)
    started = time.monotonic()
    thread.start()
    assert worker.aborted.wait(2.0), "the queued prefill was left to its deadline"
    assert time.monotonic() - started < 2.0


def _call(servicer: PrefillServicer, request) -> None:
    with contextlib.suppress(RuntimeError):  # the deadline's status, on a call nobody reads
        servicer.Prefill(request, EndedCall())
