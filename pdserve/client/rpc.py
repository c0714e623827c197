"""What the blocking and the asyncio client share: channel options, TLS, auth, errors, health.

gRPC failures surface as `PdserveError`, which keeps the status code (INVALID_ARGUMENT vs
RESOURCE_EXHAUSTED ...) and the server's message. `ClientTLS` speaks TLS to a router started
with `--tls-cert` (verifying it against a CA file, or the system's roots) and presents a
client certificate to one started with `--tls-client-ca`.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class ClientTLS:
    """TLS to the router: `ca` verifies its certificate (None: the system's roots); `cert` and
    `key` are this client's, for a router that requires client certificates."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key: give both tls cert and key")
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS {name} file {path!r} does not exist")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca),
                                            private_key=read(self.key),
                                            certificate_chain=read(self.cert))

    def ssl_context(self) -> ssl.SSLContext:
        """The same for HTTPS (the OpenAI front)."""
        context = ssl.create_default_context(cafile=self.ca)
        if self.cert is not None:
            context.load_cert_chain(self.cert, self.key)
        return context


def open_channel(address: str, tls: ClientTLS | None, aio: bool = False,
                 own_connection: bool = False):
    """A channel to the router: TLS when `tls` is given, plaintext otherwise. `own_connection`:
    a TCP connection of its own, not one shared with other channels to the same address (the
    kernel spreads connections, not streams, over `--router-processes`)."""
    kind = grpc.aio if aio else grpc
    options = [*CHANNEL_OPTIONS, *([("grpc.use_local_subchannel_pool", 1)] if own_connection
                                   else [])]
    if tls is None:
        return kind.insecure_channel(address, options=options)
    return kind.secure_channel(address, tls.channel_credentials(), options=options)


def read_token_file(path: str) -> str:
    """The API token in a file (its first line that is not blank or a `#` comment)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"api token file {path!r}: {exc.strerror}") from None
    for line in lines:
        if line.strip() and not line.strip().startswith("#"):
            return line.strip()
    raise ValueError(f"api token file {path!r} holds no token")


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
