"""What the blocking and the asyncio client share: channel options, auth, errors, health.

gRPC failures surface as `PdserveError`, which keeps the status code (INVALID_ARGUMENT vs
RESOURCE_EXHAUSTED ...) and the server's message.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2

# Reconnect within a second after a router restart, not after gRPC's default backoff (<= 120 s).
CHANNEL_OPTIONS = (("grpc.max_reconnect_backoff_ms", 1000),)
POLL_S = 0.1  # wait_ready: pause between health checks


class PdserveError(Exception):
    """A failed RPC: `code` is the grpc.StatusCode, `message` the server's details."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def auth_metadata(api_token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries the router's API token (none without one)."""
    return (("authorization", f"Bearer {api_token}"),) if api_token else ()


def error_from(exc: grpc.RpcError) -> PdserveError:
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    return PdserveError(code or grpc.StatusCode.UNKNOWN, details or "")


def status_name(response: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def not_ready(address: str, timeout: float, last: str) -> TimeoutError:
    return TimeoutError(f"pdserve at {address} not SERVING after {timeout:g} s (last: {last})")
