"""Issue 16 findings 1 and 6 on the KV channel: real TCPStore rendezvous and gloo groups.

A receiver (GlooListener, with a KVReceiver where allocations matter) faces peers that lack
the cluster secret, replay or age a request, forge the answer, send hostile or malformed
requests, name transfers nobody reserved, or post a request and never join gloo. Each must be
refused promptly with a reason, allocate nothing, and leave good peers served.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pdserve.cluster_secret import ClusterSecret
from pdserve.kvtransfer import (
    Endpoint,
    ErrorCode,
    GlooConnector,
    GlooListener,
    KVReceiver,
    KVSender,
    MessageHeader,
    TransferError,
)
from pdserve.kvtransfer.handshake import ConnectRequest, check_answer, frame_request
from pdserve.kvtransfer.header import TransferSlice
from pdserve.kvtransfer.rendezvous import make_groups, store_prefix
from tests.kvtransfer.kvdata import (
    SECRET,
    TINY,
    assert_landed,
    descriptor,
    full_caches,
    zero_caches,
)

SOURCE = Endpoint("127.0.0.1", 1000, 0)  # a prefill rank's identity (it hosts no store)
WAIT = timedelta(seconds=5)


class Recorder:
    """Listener callbacks that note what the receiver was asked to do."""

    def __init__(self) -> None:
        self.accepted: list[Endpoint] = []
        self.channels: list = []

    def accept(self, source, layout):
        self.accepted.append(source)
        return None

    def on_channel(self, source, channel) -> None:
        self.channels.append(channel)


@pytest.fixture
def listener():
    lst = GlooListener("127.0.0.1", connect_timeout_s=3, secret=SECRET)
    rec = Recorder()
    lst.listen(rec.accept, rec.on_channel)
    yield lst, rec
    for channel in rec.channels:
        channel.close("test over")
    lst.close()


def client(endpoint: Endpoint) -> dist.TCPStore:
    return dist.TCPStore(endpoint.host, endpoint.port, None, False, timeout=WAIT,
                         wait_for_workers=False)


def post_raw(store: dist.TCPStore, endpoint: Endpoint, raw: bytes) -> None:
    store.queue_push(f"{store_prefix(endpoint.rank)}/q", raw)


def answer_to(store: dist.TCPStore, endpoint: Endpoint, nonce: str) -> bytes:
    key = f"{store_prefix(endpoint.rank)}/ack/{nonce}"
    store.wait([key], WAIT)
    return store.get(key)


def refusal(endpoint: Endpoint, answer: bytes, nonce: str) -> TransferError:
    """The receiver's answer, verified with the cluster secret: it must be a refusal."""
    with pytest.raises(TransferError) as e:
        check_answer(SECRET, nonce, answer, endpoint)
    return e.value


def connect_good_peer(endpoint: Endpoint, timeout_s: float = 10.0) -> float:
    """Seconds a peer holding the secret takes to get a channel (raises if it gets none)."""
    connector = GlooConnector(SOURCE, connect_timeout_s=timeout_s, secret=SECRET)
    t0 = time.monotonic()
    try:
        channel = connector.connect(endpoint, TINY)
        assert not channel.closed
        return time.monotonic() - t0
    finally:
        connector.close()


# ---- finding 1: the handshake is authenticated both ways ----

def test_a_peer_without_the_secret_gets_no_channel(listener) -> None:
    lst, rec = listener
    intruder = GlooConnector(SOURCE, connect_timeout_s=3, secret=ClusterSecret.generate())
    t0 = time.monotonic()
    with pytest.raises(TransferError) as e:
        intruder.connect(lst.endpoint, TINY)
    intruder.close()
    assert e.value.code is ErrorCode.UNAUTHENTICATED, e.value
    assert time.monotonic() - t0 < 2.0  # refused, not timed out
    # Unsigned requests, in the old (v1, plain JSON) and in the current framing.
    store = client(lst.endpoint)
    body = json.dumps({"v": 2, "source": ["127.0.0.1", 1000, 0], "dest": [
        "127.0.0.1", lst.endpoint.port, 0], "ts": time.time(), "layout": {}}).encode()
    post_raw(store, lst.endpoint, json.dumps({"v": 1, "nonce": "cd" * 16}).encode())
    post_raw(store, lst.endpoint, frame_request(ClusterSecret.generate(), "ab" * 16, body))
    post_raw(store, lst.endpoint, f"{'ef' * 16}.{'0' * 64}.".encode() + body)
    for nonce in ("ab" * 16, "ef" * 16):
        got = refusal(lst.endpoint, answer_to(store, lst.endpoint, nonce), nonce)
        assert got.code is ErrorCode.UNAUTHENTICATED and "cluster secret" in str(got)
    assert not store.check([f"{store_prefix(0)}/ack/{'cd' * 16}"])  # no one to answer
    # Nothing was even considered: no layout compared, no group formed.
    assert rec.accepted == [] and rec.channels == []
    assert connect_good_peer(lst.endpoint) < 5.0
    assert len(rec.accepted) == 1


def test_replayed_and_stale_requests_are_refused(listener) -> None:
    lst, rec = listener
    store = client(lst.endpoint)
    fresh = ConnectRequest(SOURCE, lst.endpoint, TINY)
    post_raw(store, lst.endpoint, fresh.encode(SECRET))
    check_answer(SECRET, fresh.nonce, answer_to(store, lst.endpoint, fresh.nonce),
                 lst.endpoint)  # accepted (its sender then never joins: bounded, see 6c)
    store.delete_key(f"{store_prefix(0)}/ack/{fresh.nonce}")
    post_raw(store, lst.endpoint, fresh.encode(SECRET))  # captured and sent again
    replay = refusal(lst.endpoint, answer_to(store, lst.endpoint, fresh.nonce), fresh.nonce)
    assert replay.code is ErrorCode.UNAUTHENTICATED and "replayed" in str(replay)
    old = ConnectRequest(SOURCE, lst.endpoint, TINY, ts=time.time() - 120)
    post_raw(store, lst.endpoint, old.encode(SECRET))
    stale = refusal(lst.endpoint, answer_to(store, lst.endpoint, old.nonce), old.nonce)
    assert stale.code is ErrorCode.UNAUTHENTICATED and "stale" in str(stale)
    other = ConnectRequest(SOURCE, Endpoint("127.0.0.1", lst.endpoint.port, 1), TINY)
    post_raw(store, lst.endpoint, other.encode(SECRET))  # meant for another rank
    wrong = refusal(lst.endpoint, answer_to(store, lst.endpoint, other.nonce), other.nonce)
    assert "this receiver is" in str(wrong)
    assert len(rec.accepted) == 1 and rec.channels == []


def test_a_forged_answer_is_refused_by_the_sender() -> None:
    """A fake receiver answers "ok" (unsigned, or signed with another secret) and tries to
    join the sender's groups: the sender refuses the answer and forms no group."""
    sock = socket.create_server(("127.0.0.1", 0))
    fake = Endpoint("127.0.0.1", sock.getsockname()[1], 0)
    master = dist.TCPStore(fake.host, fake.port, None, True, timeout=WAIT,  # noqa: F841 - serves
                           wait_for_workers=False, master_listen_fd=sock.detach())
    prefix = store_prefix(0)
    joined: list[object] = []

    def fake_receiver(answer_with: ClusterSecret | None) -> None:
        store = client(fake)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                raw = store.queue_pop(f"{prefix}/q", block=False)
                break
            except dist.QueueEmptyError:
                time.sleep(0.01)
        else:
            return
        nonce = raw[:32].decode()
        text = b"ok"
        sig = "0" * 64 if answer_with is None else answer_with.sign(
            b"pdkv-answer-v2", nonce, text)
        store.set(f"{prefix}/ack/{nonce}", f"{sig}.".encode() + text)
        # Where a receiver that can't derive the pair name from the secret would meet.
        with contextlib.suppress(RuntimeError):
            joined.append(make_groups(store, f"{prefix}/pair/{nonce}", 1, "127.0.0.1",
                                      torch.device("cpu"), timedelta(seconds=1.5)))

    for answer_with in (None, ClusterSecret.generate()):
        thread = threading.Thread(target=fake_receiver, args=(answer_with,), daemon=True)
        thread.start()
        sender = GlooConnector(SOURCE, connect_timeout_s=3, secret=SECRET)
        t0 = time.monotonic()
        with pytest.raises(TransferError) as e:
            sender.connect(fake, TINY)
        elapsed = time.monotonic() - t0
        sender.close()
        thread.join(10)
        assert e.value.code is ErrorCode.UNAUTHENTICATED, e.value
        assert "not signed with this cluster's secret" in str(e.value)
        assert elapsed < 2.0, f"took {elapsed:.1f} s: it waited on groups instead of refusing"
    assert joined == []


def test_a_peer_nobody_listens_for_fails_at_once() -> None:
    """A decode worker gone since it reserved: the connect is refused, and that is PEER_LOST at
    once, not after TCPStore's retries until the timeout (twice 10 s)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = Endpoint("127.0.0.1", s.getsockname()[1], 0)  # closed again: refused
    connector = GlooConnector(SOURCE, connect_timeout_s=10, secret=SECRET)
    t0 = time.monotonic()
    with pytest.raises(TransferError) as e:
        connector.connect(gone, TINY)
    connector.close()
    assert e.value.code is ErrorCode.PEER_LOST and "connection refused" in str(e.value)
    assert time.monotonic() - t0 < 2.0


# ---- finding 6a: no staging for transfers nobody reserved ----

@pytest.fixture
def receiver():
    lst = GlooListener("127.0.0.1", connect_timeout_s=5, secret=SECRET)
    dest = zero_caches(TINY, 16, TINY.num_kv_heads)
    rx = KVReceiver(TINY, lst, 1, dest)
    yield rx, dest
    rx.close()


def _wait_closed(channel, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not channel.closed and time.monotonic() < end:
        time.sleep(0.01)


@pytest.mark.parametrize("case", ["unknown-id", "overrun"])
def test_a_layer_for_no_reservation_allocates_nothing(receiver, case: str) -> None:
    rx, dest = receiver
    desc = descriptor(TINY, [SOURCE], [rx.endpoint], [1, 2])
    rx.expect(desc)
    tx = KVSender(TINY, GlooConnector(SOURCE, connect_timeout_s=5, secret=SECRET), 1,
                  full_caches(TINY, 16, seed=4))
    channel = tx._connector.connect(rx.endpoint, TINY)
    # 64 MiB claimed: an unknown transfer id, or 1000x the 2 blocks reserved
    blocks = (64 << 20) // TINY.block_nbytes(TINY.num_kv_heads)
    tid = b"\x07" * 16 if case == "unknown-id" else desc.transfer_id
    header = MessageHeader.for_layer(TINY, 1, 0, 0, TINY.num_kv_heads,
                                     (TransferSlice(tid, 0, blocks),), desc.deadline)
    _, ops = channel.post_message(header, TINY)  # the header only: the payload never needed
    channel.wait(ops[0], time.time() + 5)
    _wait_closed(channel)
    assert channel.closed, "the receiver kept a channel that named no reservation"
    assert rx.landing.pool.allocated_nbytes == 0
    with pytest.raises(TransferError, match="refused before receiving"):
        channel.raise_if_closed()
    # The reservation is failed (its sender's channel was refused), and nothing was written.
    with pytest.raises(TransferError):
        rx.wait(desc.transfer_id, timeout=5)
    assert not any(k.any() or v.any() for k, v in dest)
    # A well-behaved transfer on the next channel still lands.
    good = descriptor(TINY, [SOURCE], [rx.endpoint], [5, 6])
    rx.expect(good)
    plans = tx.plan([(good, [3, 4])])
    for h in [tx.push_layer(layer, p) for layer in range(TINY.num_layers) for p in plans]:
        h.wait()
    assert rx.wait(good.transfer_id, timeout=10)
    assert_landed(full_caches(TINY, 16, seed=4), dest, [3, 4], [5, 6], 0, TINY.num_kv_heads)
    tx.close()


# ---- finding 6b: malformed requests are refused and never end accepting ----

def _signed(body: dict, nonce: str) -> bytes:
    return frame_request(SECRET, nonce, json.dumps(body).encode())


def test_malformed_requests_are_refused_and_good_peers_still_connect(listener) -> None:
    lst, rec = listener
    store = client(lst.endpoint)
    dest = ["127.0.0.1", lst.endpoint.port, 0]
    layout = {"model": "tiny-llama", "dtype": "float32", "block_size": 4, "num_layers": 3,
              "num_kv_heads": 4, "head_dim": 8}
    good = {"v": 2, "source": ["127.0.0.1", 1000, 0], "dest": dest, "ts": 0.0,
            "layout": layout}
    bad_bodies = {
        "list dtype": {**good, "layout": {**layout, "dtype": ["float32"]}},
        "int dtype": {**good, "layout": {**layout, "dtype": 5}},
        "float blocks": {**good, "layout": {**layout, "block_size": 4.0}},
        "huge layers": {**good, "layout": {**layout, "num_layers": 10 ** 40}},
        "huge port": {**good, "source": ["127.0.0.1", 10 ** 30, 0]},
        "bool rank": {**good, "source": ["127.0.0.1", 1000, True]},
        "missing layout": {k: v for k, v in good.items() if k != "layout"},
        "string version": {**good, "v": "2"},
        "null source": {**good, "source": None},
    }
    # Not even framed: nobody to answer; each must simply be dropped.
    post_raw(store, lst.endpoint, b"\xff\x00 not json")
    post_raw(store, lst.endpoint, b"x" * 100_000)
    post_raw(store, lst.endpoint, json.dumps({"v": 1, "nonce": "ab" * 16, "source": [
        "127.0.0.1", 1000, 0], "layout": {**layout, "dtype": ["float32"]}}).encode())
    nonces = {}
    for i, (name, body) in enumerate(bad_bodies.items()):
        nonces[name] = f"{i:032x}"
        post_raw(store, lst.endpoint, _signed({**body, "ts": time.time()}, nonces[name]))
    post_raw(store, lst.endpoint, frame_request(SECRET, "f" * 32, b"{not json"))
    for name, nonce in [*nonces.items(), ("not json", "f" * 32)]:
        got = refusal(lst.endpoint, answer_to(store, lst.endpoint, nonce), nonce)
        assert got.code is ErrorCode.PROTOCOL, (name, got)
        assert "malformed" in str(got) or "JSON" in str(got) or "keys" in str(got), (name, got)
    assert rec.accepted == [] and rec.channels == []
    assert lst._thread.is_alive()
    assert connect_good_peer(lst.endpoint) < 5.0


# ---- finding 6c: a peer that never joins gloo delays no one ----

def _stall(store: dist.TCPStore, endpoint: Endpoint) -> ConnectRequest:
    """Post a valid signed request and never join the groups."""
    request = ConnectRequest(Endpoint("127.0.0.1", 999, 0), endpoint, TINY)
    post_raw(store, endpoint, request.encode(SECRET))
    return request


def test_a_peer_that_never_joins_does_not_delay_a_good_one() -> None:
    lst = GlooListener("127.0.0.1", connect_timeout_s=10, secret=SECRET)
    rec = Recorder()
    lst.listen(rec.accept, rec.on_channel)
    try:
        store = client(lst.endpoint)
        stalled = [_stall(store, lst.endpoint) for _ in range(2)]
        t0 = time.monotonic()
        try:
            connect_good_peer(lst.endpoint, timeout_s=10)
        except TransferError as e:
            pytest.fail(f"a good peer behind stalled ones got no channel in "
                        f"{time.monotonic() - t0:.1f} s: {e}")
        elapsed = time.monotonic() - t0
        assert elapsed < 3.0, f"a good peer waited {elapsed:.1f} s behind stalled ones"
        assert len(rec.channels) == 1
        for request in stalled:  # they were accepted, and are simply left to time out
            check_answer(SECRET, request.nonce, answer_to(store, lst.endpoint, request.nonce),
                         lst.endpoint)
    finally:
        for channel in rec.channels:
            channel.close("test over")
        lst.close()


def test_pending_handshakes_are_capped_and_refused_promptly() -> None:
    lst = GlooListener("127.0.0.1", connect_timeout_s=10, secret=SECRET,
                       max_pending_handshakes=1)
    rec = Recorder()
    lst.listen(rec.accept, rec.on_channel)
    try:
        store = client(lst.endpoint)
        request = _stall(store, lst.endpoint)
        check_answer(SECRET, request.nonce, answer_to(store, lst.endpoint, request.nonce),
                     lst.endpoint)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="handshakes are already pending"):
            connect_good_peer(lst.endpoint, timeout_s=10)
        assert time.monotonic() - t0 < 2.0
    finally:
        lst.close()
