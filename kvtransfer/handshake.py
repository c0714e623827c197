"""The connect handshake: a signed ConnectRequest and a signed answer, no pickle.

A channel is opened by the *sender* (prefill rank) towards a *receiver* (decode rank). Both
hold the cluster secret (pdserve.cluster_secret); a peer without it can neither connect nor
answer. The request names the sender, the receiver it is meant for, a fresh random nonce
(the channel's store prefix derives from it, so a reconnect never meets a stale group), the
time it was made and the sender's full KV layout:

    request  b"<nonce>.<sig>." + body        nonce: 32 random hex digits
             body = JSON {"v": 2, "source": [host, port, rank], "dest": [host, port, rank],
                          "ts": time.time(), "layout": {KVLayout fields}}
             sig  = HMAC(secret, "pdkv-connect-v2", nonce, body)
    answer   b"<sig>." + text                text: "ok" | "refused:<code>:<reason>"
             sig  = HMAC(secret, "pdkv-answer-v2", nonce, text)

`open_request` (receiver) checks, in this order and before anything else happens (no group,
no buffer): size, framing, signature, freshness (|now - ts| <= MAX_AGE_S: hosts keep NTP
time, as transfer deadlines already require), that the nonce was never accepted before
(replays), the body strictly (exact keys and types), that `dest` is this receiver (a request
can't be replayed to another rank). The layout is compared by the accept callback
(`check_request`), so a mismatch is refused before a single KV byte is posted.
`check_answer` (sender) refuses an answer not signed for its nonce. The pair's groups meet
under `pair_name`, an HMAC of the nonce: reading a request from the store does not tell
anyone where the pair will rendezvous.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.cluster_secret import ClusterSecret
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.layout import KVLayout

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 3  # 3: the layout names its kind (per-head or latent)
MAX_REQUEST_BYTES = 4096
MAX_ANSWER_BYTES = 2048
MAX_AGE_S = 60.0
NONCE_HEX = 32
_SIG_HEX = 64
_HEX = frozenset("0123456789abcdef")
_REQUEST, _ANSWER, _PAIR = b"pdkv-connect-v2", b"pdkv-answer-v2", b"pdkv-pair-v2"
_BODY_KEYS = {"v", "source", "dest", "ts", "layout"}
_LAYOUT_STR = ("model", "dtype", "kind")
_LAYOUT_INT = ("block_size", "num_layers", "num_kv_heads", "head_dim")

# accept(source, layout) -> None to accept, or (code, reason) to refuse.
AcceptFn = Callable[[Endpoint, KVLayout], "tuple[ErrorCode, str] | None"]


def check_secret(secret: object) -> ClusterSecret:
    """The `secret=` argument of a connector or listener, checked at construction."""
    if not isinstance(secret, ClusterSecret):
        raise ValueError(f"secret must be the cluster's ClusterSecret (ClusterSecret.from_env()"
                         f" in a worker), got {type(secret).__name__}")
    return secret


class HandshakeRefused(ValueError):
    """A refused connect request; `nonce` is set when the sender can be answered."""

    def __init__(self, reason: str, nonce: str | None = None,
                 code: ErrorCode = ErrorCode.PROTOCOL) -> None:
        super().__init__(reason)
        self.nonce, self.code = nonce, code


@dataclass(frozen=True)
class ConnectRequest:
    source: Endpoint
    dest: Endpoint
    layout: KVLayout
    nonce: str = field(default_factory=lambda: os.urandom(NONCE_HEX // 2).hex())
    ts: float = field(default_factory=time.time)

    def encode(self, secret: ClusterSecret) -> bytes:
        body = json.dumps({"v": PROTOCOL_VERSION, "source": _wire(self.source),
                           "dest": _wire(self.dest), "ts": self.ts,
                           "layout": asdict(self.layout)}, separators=(",", ":")).encode()
        return frame_request(secret, self.nonce, body)


def frame_request(secret: ClusterSecret, nonce: str, body: bytes) -> bytes:
    """The wire form of a request body: signed for `nonce`."""
    return f"{nonce}.{secret.sign(_REQUEST, nonce, body)}.".encode() + body


class ReplayGuard:
    """The nonces accepted within the freshness window (older requests are stale anyway)."""

    def __init__(self, max_age_s: float = MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._seen: dict[str, float] = {}  # nonce -> its request's ts
        self._lock = threading.Lock()

    def admit(self, nonce: str, ts: float, now: float | None = None) -> str | None:
        """Record the nonce; or why the request is stale or a replay."""
        now = time.time() if now is None else now
        if abs(now - ts) > self.max_age_s:
            return (f"request made {now - ts:+.1f} s from now (max {self.max_age_s:.0f} s): "
                    "stale, or the two hosts' clocks differ (keep them NTP-synced)")
        with self._lock:
            for old in [n for n, t in self._seen.items() if t < now - self.max_age_s]:
                del self._seen[old]
            if nonce in self._seen:
                return "replayed request: its nonce was already used"
            self._seen[nonce] = ts
        return None


def open_request(raw: bytes, secret: ClusterSecret, replays: ReplayGuard,
                 receiver: Endpoint) -> ConnectRequest:
    """The verified request meant for `receiver`; raises HandshakeRefused."""
    nonce, sig, body = _frame(raw)
    if not secret.verify(sig, _REQUEST, nonce, body):
        raise HandshakeRefused("connect request not signed with this cluster's secret: the "
                               "sender holds another (or no) cluster secret", nonce,
                               ErrorCode.UNAUTHENTICATED)
    doc = _json(body, nonce)
    ts = doc.get("ts")
    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise HandshakeRefused("ts must be a finite number (time.time())", nonce)
    why = replays.admit(nonce, float(ts))
    if why is not None:
        raise HandshakeRefused(why, nonce, ErrorCode.UNAUTHENTICATED)
    try:
        request = _decode_body(doc, nonce, float(ts))
    except ValueError as e:
        raise HandshakeRefused(f"malformed connect request: {e}", nonce) from None
    if request.dest != receiver:
        raise HandshakeRefused(f"request is for {request.dest.key}, this receiver is "
                               f"{receiver.key}", nonce)
    return request


def check_request(accept: AcceptFn, request: ConnectRequest) -> tuple[ErrorCode, str] | None:
    """Run the receiver's accept callback; a crash in it refuses instead of killing the loop."""
    try:
        return accept(request.source, request.layout)
    except Exception as e:  # noqa: BLE001 - a bad request must not stop the listener
        logger.exception("accept callback failed for %s", request.source.key)
        return ErrorCode.PROTOCOL, f"receiver could not accept: {type(e).__name__}: {e}"


def encode_answer(secret: ClusterSecret, nonce: str,
                  refusal: tuple[ErrorCode, str] | None) -> bytes:
    text = b"ok" if refusal is None else (
        f"refused:{int(refusal[0])}:{refusal[1]}".encode()[:MAX_ANSWER_BYTES - _SIG_HEX - 1])
    return f"{secret.sign(_ANSWER, nonce, text)}.".encode() + text


def check_answer(secret: ClusterSecret, nonce: str, data: bytes, dest: Endpoint) -> None:
    """Raise TransferError unless the receiver signed an "ok" for this nonce."""
    sig, dot, text = bytes(data).partition(b".")
    if (len(data) > MAX_ANSWER_BYTES or not dot
            or not secret.verify(sig.decode("ascii", errors="replace"), _ANSWER, nonce, text)):
        raise TransferError(f"the answer from {dest.key} is not signed with this cluster's "
                            "secret (forged, or the two workers hold different cluster "
                            "secrets): no channel opened", ErrorCode.UNAUTHENTICATED)
    if text == b"ok":
        return
    _, code_text, reason = text.decode("utf-8", errors="replace").split(":", 2) if (
        text.count(b":") >= 2) else ("", "", text.decode("utf-8", errors="replace"))
    code = (ErrorCode(int(code_text)) if code_text.isdigit()
            and int(code_text) in ErrorCode._value2member_map_ else ErrorCode.PROTOCOL)
    raise TransferError(f"receiver {dest.key} refused the connection: {reason}", code)


def pair_name(secret: ClusterSecret, prefix: str, nonce: str) -> str:
    """Where the pair's groups rendezvous: only holders of the secret can name it."""
    return f"{prefix}/pair/{secret.sign(_PAIR, nonce)[:32]}"


def _wire(endpoint: Endpoint) -> list[Any]:
    return [endpoint.host, endpoint.port, endpoint.rank]


def _frame(raw: bytes) -> tuple[str, str, bytes]:
    if not isinstance(raw, bytes) or len(raw) > MAX_REQUEST_BYTES:
        raise HandshakeRefused(f"connect request is not bytes of at most {MAX_REQUEST_BYTES}")
    head, tail = raw[:NONCE_HEX + _SIG_HEX + 2], raw[NONCE_HEX + _SIG_HEX + 2:]
    nonce, sig = head[:NONCE_HEX].decode("latin-1"), head[NONCE_HEX + 1:-1].decode("latin-1")
    if (len(head) != NONCE_HEX + _SIG_HEX + 2 or head[NONCE_HEX:NONCE_HEX + 1] != b"."
            or head[-1:] != b"." or not set(nonce) <= _HEX or not set(sig) <= _HEX):
        raise HandshakeRefused(f"not a v{PROTOCOL_VERSION} connect request (<nonce>.<sig>."
                               "<body>): a peer of an older pdserve, or not a pdserve peer")
    return nonce, sig, tail


def _json(body: bytes, nonce: str) -> dict[str, Any]:
    def no_constant(name: str) -> None:
        raise ValueError(f"{name} is not a number")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({k for k, _ in pairs}) != len(pairs):
            raise ValueError("duplicate key")
        return dict(pairs)

    try:
        doc = json.loads(body.decode("utf-8"), parse_constant=no_constant,
                         object_pairs_hook=no_duplicates)
    except (ValueError, RecursionError) as e:
        raise HandshakeRefused(f"connect request body is not JSON: {e}", nonce) from None
    if not isinstance(doc, dict) or set(doc) != _BODY_KEYS:
        raise HandshakeRefused(f"connect request must have exactly the keys "
                               f"{sorted(_BODY_KEYS)}", nonce)
    return doc


def _decode_body(doc: dict[str, Any], nonce: str, ts: float) -> ConnectRequest:
    if type(doc["v"]) is not int or doc["v"] != PROTOCOL_VERSION:
        raise ValueError(f"connect protocol {doc['v']!r}, this build speaks "
                         f"{PROTOCOL_VERSION}: upgrade the older worker")
    layout = doc["layout"]
    if not isinstance(layout, dict) or set(layout) != {*_LAYOUT_STR, *_LAYOUT_INT}:
        raise ValueError(f"layout must have exactly the keys {sorted(_LAYOUT_STR + _LAYOUT_INT)}")
    if not all(type(layout[k]) is str for k in _LAYOUT_STR) or not all(
            type(layout[k]) is int for k in _LAYOUT_INT):
        raise ValueError(f"layout {_LAYOUT_STR} must be strings and {_LAYOUT_INT} ints")
    return ConnectRequest(_endpoint(doc["source"], "source"), _endpoint(doc["dest"], "dest"),
                          KVLayout(**layout), nonce, ts)


def _endpoint(value: Any, name: str) -> Endpoint:
    if not (isinstance(value, list) and len(value) == 3 and type(value[0]) is str
            and type(value[1]) is int and type(value[2]) is int):
        raise ValueError(f"{name} must be [host, port, rank]")
    return Endpoint(*value)  # bounds: DescriptorError, a ValueError
