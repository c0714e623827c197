"""The connect handshake and the two transport roles, independent of how bytes move.

A channel is always opened by the *sender* (prefill rank) towards a *receiver* (decode rank)
that listens on its rendezvous endpoint. The sender's request names its endpoint, a fresh
random nonce (the channel's store prefix, so a reconnect never meets a stale group) and its
full KV layout; the receiver compares the layout before any group exists and either refuses
(with an ErrorCode and reason that both sides raise as TransferError) or builds the channel.
So a layout mismatch is caught before a single KV byte is posted.

`Connector` (sender side) caches one channel per destination rank and reopens it once it is
closed; `Listener` (receiver side) hands accepted channels to the receiver. Implementations:
`kvtransfer.rendezvous` (TCPStore + gloo/NCCL) and `kvtransfer.loopback` (in-process).
"""

from __future__ import annotations

import abc
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pdserve.kvtransfer.channel import PairChannel
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.layout import KVLayout

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_REQUEST_BYTES = 4096
CLOSE_JOIN_S = 5.0

# accept(source, layout) -> None to accept, or (code, reason) to refuse.
AcceptFn = Callable[[Endpoint, KVLayout], "tuple[ErrorCode, str] | None"]
ChannelFn = Callable[[Endpoint, PairChannel], None]


@dataclass(frozen=True)
class ConnectRequest:
    source: Endpoint
    nonce: str  # 32 hex digits
    layout: KVLayout

    def encode(self) -> bytes:
        s = self.source
        return json.dumps({"v": PROTOCOL_VERSION, "source": [s.host, s.port, s.rank],
                           "nonce": self.nonce, "layout": asdict(self.layout)}).encode()

    @classmethod
    def decode(cls, data: bytes) -> ConnectRequest:
        """Strict: size cap, exact keys and types; raises ValueError."""
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError(f"connect request of {len(data)} bytes (max {MAX_REQUEST_BYTES})")
        try:
            doc = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise ValueError(f"connect request is not JSON: {e}") from None
        if not isinstance(doc, dict) or set(doc) != {"v", "source", "nonce", "layout"}:
            raise ValueError("connect request must have keys v, source, nonce, layout")
        if doc["v"] != PROTOCOL_VERSION:
            raise ValueError(f"connect protocol {doc['v']!r}, this build speaks "
                             f"{PROTOCOL_VERSION}: upgrade the older worker")
        source, nonce, layout = doc["source"], doc["nonce"], doc["layout"]
        if not (isinstance(source, list) and len(source) == 3 and isinstance(source[0], str)):
            raise ValueError("source must be [host, port, rank]")
        if not (isinstance(nonce, str) and len(nonce) == 32
                and all(c in "0123456789abcdef" for c in nonce)):
            raise ValueError("nonce must be 32 lowercase hex digits")
        fields = {"model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim"}
        if not isinstance(layout, dict) or set(layout) != fields:
            raise ValueError(f"layout must have exactly the keys {sorted(fields)}")
        return cls(Endpoint(*source), nonce, KVLayout(**layout))


def encode_answer(refusal: tuple[ErrorCode, str] | None) -> bytes:
    return b"ok" if refusal is None else f"refused:{int(refusal[0])}:{refusal[1]}".encode()


def decode_answer(data: bytes, dest: Endpoint) -> None:
    """Raise TransferError if the receiver refused the connection."""
    text = data.decode("utf-8", errors="replace")[:2048]
    if text == "ok":
        return
    _, code_text, reason = text.split(":", 2) if text.count(":") >= 2 else ("", "", text)
    code = (ErrorCode(int(code_text)) if code_text.isdigit()
            and int(code_text) in ErrorCode._value2member_map_ else ErrorCode.PROTOCOL)
    raise TransferError(f"receiver {dest.key} refused the connection: {reason}", code)


class Connector(abc.ABC):
    """Sender side: one cached channel per destination rank, reopened after a close.
    Transports implement `_open` (gloo over a TCPStore, or the in-process loopback)."""

    def __init__(self, source: Endpoint) -> None:
        self.source = source
        self._channels: dict[str, PairChannel] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._closed = False

    def connect(self, dest: Endpoint, layout: KVLayout) -> PairChannel:
        """The open channel to `dest`, opening one if needed; raises TransferError."""
        with self._lock:
            if self._closed:
                raise TransferError("sender transport is closed", ErrorCode.SHUTDOWN)
            lock = self._locks.setdefault(dest.key, threading.Lock())
        with lock:
            channel = self._channels.get(dest.key)
            if channel is not None and not channel.closed:
                return channel
            channel = self._open(dest, layout)
            channel.start_watchdog()
            self._channels[dest.key] = channel
            logger.info("channel %s: %s -> %s", channel.name, self.source.key, dest.key)
            return channel

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close("sender closed")
        for channel in channels:
            channel.join(CLOSE_JOIN_S)
        self._close_transport()

    @abc.abstractmethod
    def _open(self, dest: Endpoint, layout: KVLayout) -> PairChannel:
        """Handshake with `dest` (layouts compared) and return the pair's channel."""

    @abc.abstractmethod
    def _close_transport(self) -> None:
        """Release what the transport holds besides the channels (store clients, ...)."""


class Listener(abc.ABC):
    """Receiver side: accepts channels on `endpoint` until closed."""

    endpoint: Endpoint

    @abc.abstractmethod
    def listen(self, accept: AcceptFn, on_channel: ChannelFn) -> None:
        """Start accepting: `accept` vets each request, `on_channel` gets each new channel."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop accepting."""


def check_request(accept: AcceptFn, request: ConnectRequest) -> tuple[ErrorCode, str] | None:
    """Run the receiver's accept callback; a crash in it refuses instead of killing the loop."""
    try:
        return accept(request.source, request.layout)
    except Exception as e:  # noqa: BLE001 - a bad request must not stop the listener
        logger.exception("accept callback failed for %s", request.source.key)
        return ErrorCode.PROTOCOL, f"receiver could not accept: {type(e).__name__}: {e}"

