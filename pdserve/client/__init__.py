"""Client and AsyncClient: the Python face of the router's public gRPC API (proto/pdserve.proto).

`generate` streams `GenerateChunk`s; `complete` runs a stream to the end into a `Completion`.
Leaving a stream early (break, `close()`, garbage collection, task cancellation) cancels the
RPC, so the router frees the request's KV blocks at once instead of generating into the void.
gRPC failures surface as `PdserveError`, which keeps the status code (INVALID_ARGUMENT vs
RESOURCE_EXHAUSTED ...).

- `sync`: `Client`, blocking, over one gRPC channel.
- `aio`: `AsyncClient`, the same API over grpc.aio.
- `messages`: what a call returns (`GenerateChunk`, `Completion`, `Usage`, `Timings`) and the
  conversions to and from the protobuf messages.
- `rpc`: what both clients share: channel options, `ClientTLS`, auth metadata, `PdserveError`.
- `options`: the command-line flags of a client (`--api-token-file`, `--tls-ca`, ...).
"""

from __future__ import annotations

from pdserve.client.aio import AsyncClient
from pdserve.client.messages import (
    Completion,
    GenerateChunk,
    Timings,
    ToolCall,
    Usage,
    build_request,
    chunk_from_proto,
    collect,
)
from pdserve.client.rpc import ClientTLS, PdserveError
from pdserve.client.sync import Client

__all__ = [
    "AsyncClient", "Client", "ClientTLS", "Completion", "GenerateChunk", "PdserveError",
    "Timings", "ToolCall", "Usage", "build_request", "chunk_from_proto", "collect",
]
