"""Issue 17 on the decode worker: per-router Outputs subscriptions and the owner lease.

A real TP-1 decode worker on the tiny model behind its real, authenticated gRPC server; each
"router" here is an Outputs stream opened with its router_id, and Reserve / Submit calls that
carry it.
    - two routers each receive exactly their own requests' deltas, complete, none of the other's
    - a second Outputs of one router ends the first (ABORTED); the new one gets the deltas
    - a router with no stream for orphan_after_s has its requests aborted (every block back);
      one that re-subscribes within the grace keeps its requests
    - a bad router_id is INVALID_ARGUMENT naming router_id, and nothing is queued
    - a dead engine loop's error deltas reach each owner before its stream ends UNAVAILABLE
    - benchmarks.synthetic_decode routes by owner the same way
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import grpc
import pytest

from benchmarks.synthetic_decode import SyntheticDecode
from pdserve.decode_worker.group import start_decode_rank
from pdserve.decode_worker.service import DecodeService
from pdserve.engine.models.parallel import TensorParallel
from pdserve.kvtransfer.rendezvous import GlooListener
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.worker_grpc import bind, worker_server
from tests.faults.worker_plane import (
    AUTH,
    PROMPT,
    SECRET,
    decode_stub,
    sampling,
    wait_until,
    worker_spec,
)

ORPHAN_AFTER_S = 1.0
SLACK_S = 15.0  # 2 shared cores: scheduling, a stream closing
NOWHERE = worker_pb2.Endpoint(host="127.0.0.1", port=9, rank=0)  # a prefill that never pushes
_SERIAL = itertools.count()


def start_decode(model_dir, worker_id: str) -> DecodeService:
    spec = worker_spec(model_dir, worker_id)
    listener = GlooListener(spec.host, secret=SECRET)
    worker = start_decode_rank(spec.engine_config(), TensorParallel(), listener,
                               [listener.endpoint], spec.model_name,
                               max_reservation_s=spec.max_reservation_s, tp_beat_s=spec.tp_beat_s)
    return DecodeService(worker, worker_id, spec.host, SECRET, orphan_after_s=ORPHAN_AFTER_S)


@pytest.fixture(scope="module")
def decode(tiny_llama_dir):
    service = start_decode(tiny_llama_dir, "decode-subs")
    channel, stub = decode_stub(service.address)
    service.stub = stub
    yield service
    channel.close()
    service.stop()


class Router:
    """One router's Outputs stream, read in a thread: its messages and how it ended."""

    def __init__(self, service, router_id: str) -> None:
        """`service`: anything with the DecodeWorker `stub` to call."""
        self.router_id, self.stub = router_id, service.stub
        self.call = self.stub.Outputs(worker_pb2.OutputsRequest(router_id=router_id),
                                      metadata=AUTH, timeout=300)
        self.messages: list[worker_pb2.StepOutputs] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.call.initial_metadata()  # subscribed once the worker has answered
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                self.messages.append(message)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""

    def deltas(self) -> list[worker_pb2.RequestDelta]:
        return [d for m in list(self.messages) for d in m.deltas]

    def finished(self, rid: str) -> bool:
        return any(d.request_id == rid and d.finish_reason for d in self.deltas())

    def submit(self, rid: str, max_tokens: int) -> None:
        assert self.stub.Submit(worker_pb2.SubmitRequest(
            request_id=rid, prompt_token_ids=PROMPT, sampling=sampling(max_tokens),
            router_id=self.router_id), metadata=AUTH, timeout=30).granted

    def reserve(self, rid: str) -> None:
        """A reservation nobody feeds: it holds its blocks until its deadline (60 s)."""
        assert self.stub.Reserve(worker_pb2.ReserveRequest(
            request_id=rid, prompt_token_ids=PROMPT, sampling=sampling(),
            sources=[NOWHERE], deadline=time.time() + 60, router_id=self.router_id),
            metadata=AUTH, timeout=30).granted

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(10)


def rid(name: str) -> str:
    return f"{name}-{next(_SERIAL)}"


def stats(service: DecodeService):
    return service.worker.stats()


def lease_warnings(caplog) -> list[str]:
    return [rec.getMessage() for rec in caplog.records
            if rec.name == "pdserve.decode_worker.subscriptions"]


def wait_all_free(service: DecodeService) -> None:
    def free() -> bool:
        s = stats(service)
        return s.num_free_blocks == s.num_blocks and s.num_running == s.num_reserved == 0
    wait_until(free, SLACK_S, "every block free")


def test_each_router_gets_exactly_its_own_requests(decode):
    a, b = Router(decode, "a"), Router(decode, "b")
    try:
        mine = {a: {rid("a"): n for n in (5, 9, 13)}, b: {rid("b"): n for n in (7, 11)}}
        for router, requests in mine.items():
            for r, n in requests.items():
                router.submit(r, n)
        for router, requests in mine.items():
            for r in requests:
                wait_until(lambda ro=router, r=r: ro.finished(r), SLACK_S, f"{r} finished")
        for router, requests in mine.items():
            deltas = router.deltas()
            assert {d.request_id for d in deltas} == set(requests), router.router_id
            for r, n in requests.items():
                tokens = [t for d in deltas if d.request_id == r for t in d.token_ids]
                assert len(tokens) == n, (r, len(tokens))
                assert [d.finish_reason for d in deltas if d.request_id == r][-1] == "length"
                # one delta per step: never two of one request in one message
            for m in router.messages:
                assert len({d.request_id for d in m.deltas}) == len(m.deltas), m
        assert a.code is None and b.code is None  # both still open
    finally:
        a.close()
        b.close()
    wait_all_free(decode)


def test_a_second_subscription_replaces_the_first(decode):
    first = Router(decode, "again")
    second = Router(decode, "again")
    try:
        wait_until(lambda: first.code is not None, SLACK_S, "the first stream ended")
        assert first.code == grpc.StatusCode.ABORTED and "replaced" in first.details, \
            (first.code, first.details)
        r = rid("again")
        second.submit(r, 6)
        wait_until(lambda: second.finished(r), SLACK_S, f"{r} finished")
        tokens = [t for d in second.deltas() if d.request_id == r for t in d.token_ids]
        assert len(tokens) == 6
        assert first.deltas() == []
        assert second.code is None
    finally:
        first.close()
        second.close()
    wait_all_free(decode)


def test_an_orphaned_router_loses_its_requests_a_returning_one_keeps_them(decode, caplog):
    gone, keep = Router(decode, "gone"), Router(decode, "keep")
    gone_ids, keep_ids = [rid("gone") for _ in range(2)], [rid("keep") for _ in range(2)]
    try:
        for r in gone_ids:
            gone.reserve(r)
        for r in keep_ids:
            keep.reserve(r)
        assert stats(decode).num_reserved == 4
        with caplog.at_level(logging.WARNING, logger="pdserve.decode_worker.subscriptions"):
            gone.close()
            keep.close()
            keep = Router(decode, "keep")  # back within the grace
            # only gone's reservations go, well before their 60 s deadline
            wait_until(lambda: stats(decode).num_reserved == 2, ORPHAN_AFTER_S + SLACK_S,
                       "the orphaned router's requests aborted")
            time.sleep(2 * ORPHAN_AFTER_S + 0.5)  # past any lease keep could still be on
        warnings = lease_warnings(caplog)
        assert len(warnings) == 1 and "'gone'" in warnings[0] and " 2 requests" in warnings[0], \
            warnings
        assert stats(decode).num_reserved == 2
        for r in keep_ids:  # still held: they were never aborted
            assert decode.stub.Abort(worker_pb2.WorkerAbortRequest(request_id=r),
                                     metadata=AUTH, timeout=30).found, r
        r = rid("keep")  # and the new stream serves the router
        keep.submit(r, 4)
        wait_until(lambda: keep.finished(r), SLACK_S, f"{r} finished")
    finally:
        gone.close()
        keep.close()
    wait_all_free(decode)


def test_a_running_request_of_a_killed_router_is_aborted(decode, caplog):
    """A decoding request (not only a reservation) is aborted once its router's lease ends.
    The tiny model would finish it within a second, so the loop is held between two steps
    (the request mid-decode) until the lease's abort is queued behind the hold."""
    router, r = Router(decode, "killed"), rid("killed")
    loop, gate = decode.worker._loop, threading.Event()
    with caplog.at_level(logging.WARNING, logger="pdserve.decode_worker.subscriptions"):
        router.submit(r, 460)
        wait_until(lambda: any(d.request_id == r for d in router.deltas()), SLACK_S,
                   "decoding")
        loop.submit(gate.wait)
        try:
            wait_until(lambda: loop._queue.qsize() == 0, SLACK_S, "the loop held")
            router.close()
            wait_until(lambda: loop._queue.qsize() >= 1, ORPHAN_AFTER_S + SLACK_S,
                       "the lease's abort queued")
        finally:
            gate.set()
        wait_all_free(decode)
        # found in flight: the abort, not the end of its 460 tokens, ended it
        wait_until(lambda: any("'killed'" in w and " 1 requests" in w
                               for w in lease_warnings(caplog)), SLACK_S, "the lease warning")
    assert not router.finished(r)  # its stream was gone before it ended


BAD_IDS = {"too-long": "r" * 65, "space": "router 1", "slash": "router/1", "non-ascii": "rö"}


@pytest.mark.parametrize("bad", BAD_IDS.values(), ids=BAD_IDS.keys())
def test_a_bad_router_id_is_invalid_argument_and_queues_nothing(decode, bad):
    stub, r = decode.stub, rid("bad")
    calls = {
        "Reserve": lambda: stub.Reserve(worker_pb2.ReserveRequest(
            request_id=r, prompt_token_ids=PROMPT, sampling=sampling(), sources=[NOWHERE],
            deadline=time.time() + 60, router_id=bad), metadata=AUTH, timeout=30),
        "Submit": lambda: stub.Submit(worker_pb2.SubmitRequest(
            request_id=r, prompt_token_ids=PROMPT, sampling=sampling(), router_id=bad),
            metadata=AUTH, timeout=30),
        "Outputs": lambda: next(stub.Outputs(worker_pb2.OutputsRequest(router_id=bad),
                                             metadata=AUTH, timeout=30)),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert "router_id" in (info.value.details() or ""), (name, info.value.details())
    s = stats(decode)
    assert s.num_running == s.num_reserved == s.num_waiting == 0
    assert s.num_free_blocks == s.num_blocks
    # the longest valid id is taken
    ok = Router(decode, "r." * 31 + "-:")
    try:
        ok.submit(r, 3)
        wait_until(lambda: ok.finished(r), SLACK_S, f"{r} finished")
    finally:
        ok.close()


def test_a_dead_loop_delivers_each_routers_error_deltas_then_ends(tiny_llama_dir, monkeypatch):
    service = start_decode(tiny_llama_dir, "decode-dies")
    channel, service.stub = decode_stub(service.address)
    a, b = Router(service, "a"), Router(service, "b")
    try:
        ra, rb = rid("a"), rid("b")
        a.reserve(ra)  # in flight until the loop dies (no KV ever comes)
        b.reserve(rb)

        def boom():
            raise RuntimeError("injected step failure")
        monkeypatch.setattr(service.worker.core, "step", boom)
        for router, mine, other in ((a, ra, rb), (b, rb, ra)):
            wait_until(lambda ro=router: ro.code is not None, SLACK_S, "the stream ended")
            assert router.code == grpc.StatusCode.UNAVAILABLE, (router.code, router.details)
            assert [(d.request_id, d.finish_reason) for d in router.deltas()] == \
                [(mine, "error")], other
            assert "injected" in router.deltas()[0].error
    finally:
        a.close()
        b.close()
        channel.close()
        service.stop()


def test_the_synthetic_decode_worker_routes_by_owner_too():
    worker = SyntheticDecode([11, 12, 13], step_s=0.005)
    server = worker_server(SECRET, 16, "synthetic-test")
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(worker, server)
    port = bind(server, "127.0.0.1", None)
    server.start()
    stop = threading.Event()
    clock = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    clock.start()
    channel, worker.stub = decode_stub(f"127.0.0.1:{port}")
    a, b = Router(worker, "a"), Router(worker, "b")
    try:
        mine = {a: {rid("a"): 3, rid("a"): 5}, b: {rid("b"): 4}}
        for router, requests in mine.items():
            for r, n in requests.items():
                router.submit(r, n)
        for router, requests in mine.items():
            for r, n in requests.items():
                wait_until(lambda ro=router, r=r: ro.finished(r), SLACK_S, f"{r} finished")
                assert sum(len(d.token_ids) for d in router.deltas() if d.request_id == r) == n
            assert {d.request_id for d in router.deltas()} == set(requests), router.router_id
        again = Router(worker, "a")  # replaces a's stream, which ends
        wait_until(lambda: a.code is not None, SLACK_S, "the replaced stream ended")
        r = rid("a")
        again.submit(r, 2)
        wait_until(lambda: again.finished(r), SLACK_S, f"{r} finished")
        assert r not in {d.request_id for d in a.deltas() + b.deltas()}
        again.close()
    finally:
        a.close()
        b.close()
        channel.close()
        stop.set()
        clock.join(10)
        server.stop(grace=0).wait()
