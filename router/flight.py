"""Flight and Placement: what the router knows of one in-flight request.

Both the router (which places and releases requests) and the response stream (which reads
the placed request's output) work on these; neither owns the other.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pdserve.proto import worker_pb2
from pdserve.router.workers import DecodeClient, PrefillClient


@dataclass
class Flight:
    """Who holds one request's state, under which id (a retry after a lost prefill worker
    uses a fresh one, so no late message of the first attempt can reach the second)."""

    request_id: str
    worker_request_id: str = ""
    decode: DecodeClient | None = None
    prefill: PrefillClient | None = None
    aborted: bool = False
    done: bool = False


@dataclass
class Placement:
    """Where a request runs: its decode worker, that worker's output queue for it, and the
    prefill worker's answer (None: prefilled on the decode worker)."""

    decode: DecodeClient
    queue: asyncio.Queue
    prefill: worker_pb2.PrefillResponse | None = None
    session_hit: int = 0
