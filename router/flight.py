"""Flight and Placement: what the router knows of one in-flight request.

Both the router (which places and releases requests) and the response stream (which reads
the placed request's output) work on these; neither owns the other.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from dataclasses import dataclass, field

from pdserve.proto import worker_pb2
from pdserve.router.decode_client import DecodeClient
from pdserve.router.mailbox import Mailbox
from pdserve.router.workers import PrefillClient

ID_PREFIX_CHARS = 64  # of the client's request_id, kept in worker ids for the logs
_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")


def new_worker_request_id(request_id: str) -> str:
    """A fresh worker-side id for one attempt at a request: readable prefix + 64 random bits.

    Unique per attempt, so nothing of an earlier attempt (or of a cancelled request whose id
    the client reused) can reach this one; at most 81 characters whatever the client's id, so
    it always fits a transfer descriptor's 256.
    """
    return f"{_UNSAFE.sub('_', request_id[:ID_PREFIX_CHARS])}~{secrets.token_hex(8)}"


@dataclass
class Flight:
    """Who holds one request's state, under which worker-side id (fresh for every attempt)."""

    request_id: str
    worker_request_id: str = ""
    decode: DecodeClient | None = None
    prefill: PrefillClient | None = None
    aborted: bool = False
    done: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set when it left the router


@dataclass
class Placement:
    """Where a request runs: its decode worker, that worker's mailbox for it, and the
    prefill worker's answer (None: prefilled on the decode worker)."""

    decode: DecodeClient
    mailbox: Mailbox
    prefill: worker_pb2.PrefillResponse | None = None
    session_hit: int = 0
