"""In-process transport: the same KVSender/KVReceiver over queues instead of sockets.

For unit tests of the workers (no ports, no processes). Only the byte transport is faked:
`LoopbackGroup` mimics the parts of a 2-rank gloo group the channel uses — tagged FIFO
send/recv that move data only once both sides posted, a wait that closes the whole group
when it times out, `abort()` — so headers, validation, packing, unpacking, deadlines and
channel failures run the production code paths.

    hub = LoopbackHub()
    receiver = KVReceiver(layout, hub.listener(endpoint, secret=secret), dest_tp, kv_caches)
    sender = KVSender(layout, hub.connector(source, secret=secret), source_tp, kv_caches)

The handshake is the real one (kvtransfer.handshake), signed and verified with each side's
own secret, so a connector holding another secret is refused here as over gloo.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from datetime import timedelta

import torch

from pdserve.cluster_secret import ClusterSecret
from pdserve.kvtransfer.channel import RECEIVER, SENDER, PairChannel
from pdserve.kvtransfer.connector import AcceptFn, ChannelFn, Connector, Listener
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.handshake import (
    ConnectRequest,
    HandshakeRefused,
    ReplayGuard,
    check_answer,
    check_request,
    check_secret,
    encode_answer,
    open_request,
)
from pdserve.kvtransfer.layout import KVLayout

logger = logging.getLogger(__name__)


class _Work:
    def __init__(self, link: _Link) -> None:
        self._link, self._done = link, threading.Event()
        self.delivered = False  # set under the link's lock when the data moved

    def wait(self, timeout: timedelta) -> bool:
        if not self._done.wait(timeout.total_seconds()):
            self._link.close("Application timeout caused pair closure")
            raise RuntimeError(f"Timed out waiting {timeout.total_seconds() * 1000:.0f}ms")
        if not self.delivered:
            raise RuntimeError(self._link.error or "closed")
        return True


class _Link:
    """Both directions between two ranks: per (destination rank, tag) FIFO queues."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sends: dict[tuple[int, int], deque] = {}
        self._recvs: dict[tuple[int, int], deque] = {}
        self.error: str | None = None

    def post(self, is_send: bool, tensor: torch.Tensor, dst: int, tag: int) -> _Work:
        work = _Work(self)
        with self._lock:
            if self.error is not None:
                raise RuntimeError(self.error)
            mine, theirs = (self._sends, self._recvs) if is_send else (self._recvs, self._sends)
            waiting = theirs.get((dst, tag))
            if not waiting:
                mine.setdefault((dst, tag), deque()).append((tensor, work))
                return work
            other, other_work = waiting.popleft()
            src, out = (tensor, other) if is_send else (other, tensor)
            if src.numel() != out.numel():
                self._close_locked("Message size mismatch")
                raise RuntimeError(self.error)
            out.copy_(src)
            work.delivered = other_work.delivered = True
        work._done.set()
        other_work._done.set()
        return work

    def close(self, error: str) -> None:
        with self._lock:
            self._close_locked(error)

    def _close_locked(self, error: str) -> None:
        if self.error is not None:
            return
        self.error = error
        for queues in (self._sends, self._recvs):
            for queue in queues.values():
                for _, work in queue:
                    work._done.set()  # wakes the waiter, which sees the error
            queues.clear()


class LoopbackGroup:
    """One rank's view of a `_Link`, with the ProcessGroup methods PairChannel calls."""

    def __init__(self, link: _Link, rank: int) -> None:
        self._link, self._rank = link, rank

    def name(self) -> str:
        return "loopback"

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        return self._link.post(True, tensors[0], dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        return self._link.post(False, tensors[0], self._rank, tag)

    def abort(self) -> None:
        self._link.close("Connection closed by peer")


class _DictReasons:
    def __init__(self) -> None:
        self._reasons: dict[str, str] = {}
        self._lock = threading.Lock()

    def publish(self, key: str, reason: str) -> None:
        with self._lock:
            self._reasons[key] = reason

    def fetch(self, key: str) -> str | None:
        with self._lock:
            return self._reasons.get(key)


class LoopbackHub:
    """The 'network': listeners by endpoint key, and the board for close reasons."""

    def __init__(self) -> None:
        self._listeners: dict[str, LoopbackListener] = {}
        self._lock = threading.Lock()
        self.reasons = _DictReasons()

    def listener(self, endpoint: Endpoint, *, secret: ClusterSecret) -> LoopbackListener:
        return LoopbackListener(self, endpoint, secret=secret)

    def connector(self, source: Endpoint, *, secret: ClusterSecret) -> LoopbackConnector:
        return LoopbackConnector(self, source, secret=secret)

    def _register(self, listener: LoopbackListener) -> None:
        with self._lock:
            if listener.endpoint.key in self._listeners:
                raise ValueError(f"endpoint {listener.endpoint.key} is already listening")
            self._listeners[listener.endpoint.key] = listener

    def _unregister(self, listener: LoopbackListener) -> None:
        with self._lock:
            self._listeners.pop(listener.endpoint.key, None)

    def _find(self, dest: Endpoint) -> LoopbackListener | None:
        with self._lock:
            return self._listeners.get(dest.key)


class LoopbackListener(Listener):
    def __init__(self, hub: LoopbackHub, endpoint: Endpoint, *, secret: ClusterSecret) -> None:
        self.endpoint, self._hub = endpoint, hub
        self._secret, self._replays = check_secret(secret), ReplayGuard()
        self._callbacks: tuple[AcceptFn, ChannelFn] | None = None

    def listen(self, accept: AcceptFn, on_channel: ChannelFn) -> None:
        self._callbacks = (accept, on_channel)
        self._hub._register(self)

    def close(self) -> None:
        self._hub._unregister(self)

    def answer(self, raw: bytes) -> tuple[bytes | None, ConnectRequest | None]:
        """The signed answer to an encoded request (None: unframed, nobody to tell), and the
        request if it was accepted: the checks GlooListener makes."""
        assert self._callbacks is not None
        try:
            request = open_request(raw, self._secret, self._replays, self.endpoint)
        except HandshakeRefused as e:
            logger.warning("refused a peer on %s: %s", self.endpoint.key, e)
            refused = None if e.nonce is None else encode_answer(self._secret, e.nonce,
                                                                 (e.code, str(e)))
            return refused, None
        refusal = check_request(self._callbacks[0], request)
        return (encode_answer(self._secret, request.nonce, refusal),
                request if refusal is None else None)


class LoopbackConnector(Connector):
    def __init__(self, hub: LoopbackHub, source: Endpoint, *, secret: ClusterSecret) -> None:
        super().__init__(source)
        self._hub, self._secret = hub, check_secret(secret)

    def _open(self, dest: Endpoint, layout: KVLayout) -> PairChannel:
        listener = self._hub._find(dest)
        if listener is None or listener._callbacks is None:
            raise TransferError(f"no receiver listens at {dest.key}", ErrorCode.PEER_LOST)
        on_channel = listener._callbacks[1]
        request = ConnectRequest(self.source, dest, layout)
        answer, _ = listener.answer(request.encode(self._secret))
        check_answer(self._secret, request.nonce, answer or b"", dest)
        name = f"loopback/{dest.key}/{request.nonce}"
        control, data = _Link(), _Link()
        theirs = PairChannel(LoopbackGroup(control, RECEIVER), LoopbackGroup(data, RECEIVER),
                             rank=RECEIVER, name=name, peer_key=self.source.key,
                             reasons=self._hub.reasons, device=torch.device("cpu"))
        on_channel(self.source, theirs)
        return PairChannel(LoopbackGroup(control, SENDER), LoopbackGroup(data, SENDER),
                           rank=SENDER, name=name, peer_key=dest.key, reasons=self._hub.reasons,
                           device=torch.device("cpu"))

    def _close_transport(self) -> None:
        """The hub is shared by every loopback peer: nothing of this connector's to release."""
