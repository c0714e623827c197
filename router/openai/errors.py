"""Router exceptions -> HTTP statuses and OpenAI's error JSON.

400 a bad parameter (named in `param`), 401 a missing or wrong API key, 404 an unknown model,
413 a body over the limit, 429 the admission queue is full or the request was rejected early
(every prefill worker predicted to miss the TTFT SLO; `Retry-After` says when to retry), 503
no worker can take the request
(none up, none with KV room in time, or the one holding it died) or the service drains, 504
the deadline passed.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from pdserve.router.admission import Overloaded, ShuttingDown
from pdserve.router.invalid_argument import BadParameter, InvalidArgument
from pdserve.router.placement import NoCapacity, TTFTUnmeetable
from pdserve.router.stream import WorkerFailed
from pdserve.router.workers import WorkerLost

TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
         404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "server_error", 504: "server_error"}
CODES = {401: "invalid_api_key", 404: "model_not_found", 413: "request_too_large",
         429: "overloaded", 503: "service_unavailable", 504: "timeout"}


class HTTPError(Exception):
    """An error answered before any generation starts (auth, model, body size)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def status_of(exc: BaseException) -> tuple[int, str]:
    """The HTTP status of an exception, and the request status the router's metrics count."""
    if isinstance(exc, HTTPError):
        return exc.status, "invalid"
    if isinstance(exc, InvalidArgument):
        return 400, "invalid"
    if isinstance(exc, (Overloaded, TTFTUnmeetable)):
        return 429, "overloaded"
    if isinstance(exc, NoCapacity):
        return 503, "overloaded"
    if isinstance(exc, (WorkerLost, WorkerFailed, ShuttingDown)):
        return 503, "unavailable"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return 504, "deadline"
    return 500, "error"


def error_headers(exc: BaseException) -> list[tuple[bytes, bytes]]:
    """Headers an error answer carries besides its JSON: `Retry-After` (whole seconds) when
    the router can say when to retry."""
    if isinstance(exc, TTFTUnmeetable):
        return [(b"retry-after", str(max(1, math.ceil(exc.retry_after_s))).encode())]
    return []


def error_body(status: int, exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        message = "the request's deadline passed before it finished"
    else:
        message = str(exc) or type(exc).__name__
    param = exc.param if isinstance(exc, (BadParameter, HTTPError)) else None
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"),
                      "param": param, "code": CODES.get(status)}}
