"""ClusterSecret: the one shared secret that authenticates the worker plane.

Every process of a cluster (router, prefill workers, decode ranks) holds the same secret;
nothing else may speak on the worker plane. `pdserve up` generates it (or takes it from
`PDSERVE_CLUSTER_SECRET` / `PDSERVE_CLUSTER_SECRET_FILE`, e.g. a Kubernetes Secret) and hands
it to workers through their environment (Ray's runtime_env), never argv or logs.

Two uses, neither of which puts the secret itself on the wire:
- gRPC worker RPCs carry `x-pdserve-cluster-auth: <HMAC(secret, "grpc-worker-v1")>`, checked
  in constant time by `ClusterAuthInterceptor` before any handler runs (UNAUTHENTICATED).
- KV channel handshakes are signed: `sign(*parts)` is an HMAC-SHA256 over length-prefixed
  parts, so a peer that does not hold the secret can neither connect nor answer.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

ENV = "PDSERVE_CLUSTER_SECRET"
ENV_FILE = "PDSERVE_CLUSTER_SECRET_FILE"
METADATA_KEY = "x-pdserve-cluster-auth"
MIN_BYTES = 16
_GRPC_PURPOSE = b"grpc-worker-v1"


@dataclass(frozen=True, repr=False)
class ClusterSecret:
    value: bytes

    def __post_init__(self) -> None:
        if len(self.value) < MIN_BYTES:
            raise ValueError(f"the cluster secret must be at least {MIN_BYTES} bytes "
                             f"(generate one with `openssl rand -hex 32`)")

    def __repr__(self) -> str:  # never in a log line
        return "ClusterSecret(<redacted>)"

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_hex(32).encode())

    @classmethod
    def from_text(cls, text: str) -> ClusterSecret:
        return cls(text.strip().encode())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClusterSecret:
        """This process's secret: $PDSERVE_CLUSTER_SECRET, else the file named by ..._FILE."""
        environ = os.environ if environ is None else environ
        if environ.get(ENV):
            return cls.from_text(environ[ENV])
        if environ.get(ENV_FILE):
            return cls.from_text(Path(environ[ENV_FILE]).read_text())
        raise ValueError(f"no cluster secret: set {ENV} (or {ENV_FILE} to a file holding it); "
                         f"`pdserve up` generates one and hands it to the workers it starts")

    def to_env(self) -> dict[str, str]:
        """The environment a worker process needs (for Ray's runtime_env)."""
        return {ENV: self.value.decode()}

    # ---- KV handshakes ----

    def sign(self, *parts: bytes | str) -> str:
        mac = hmac.new(self.value, digestmod=hashlib.sha256)
        for part in parts:
            data = part.encode() if isinstance(part, str) else part
            mac.update(len(data).to_bytes(8, "big"))
            mac.update(data)
        return mac.hexdigest()

    def verify(self, signature: str, *parts: bytes | str) -> bool:
        return hmac.compare_digest(signature.encode(), self.sign(*parts).encode())

    # ---- gRPC ----

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata every worker RPC carries."""
        return ((METADATA_KEY, self.sign(_GRPC_PURPOSE)),)

    def check_grpc_metadata(self, metadata) -> bool:
        given = dict(metadata or ()).get(METADATA_KEY, "")
        return isinstance(given, str) and self.verify(given, _GRPC_PURPOSE)


class ClusterAuthInterceptor(grpc.ServerInterceptor):
    """A worker's gRPC server: every call without the cluster's token is UNAUTHENTICATED."""

    def __init__(self, secret: ClusterSecret) -> None:
        self._secret = secret

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or self._secret.check_grpc_metadata(
                handler_call_details.invocation_metadata):
            return handler
        return refusal(handler, _deny, _deny_stream)


def _deny(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED,
                  f"worker RPCs need the cluster secret (metadata {METADATA_KEY})")


def _deny_stream(request, context):
    _deny(request, context)
    yield  # pragma: no cover - never reached: abort raised


def refusal(handler: grpc.RpcMethodHandler, deny, deny_stream) -> grpc.RpcMethodHandler:
    """`handler` replaced by one that refuses the call (`deny`, or `deny_stream` for a
    server-streaming method), keeping its (de)serializers; sync or grpc.aio alike."""
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
