"""GrpcServer: gRPC over HTTP/2 on the running event loop (uvloop in the router).

Why not grpc.aio: its per-message cost is a completion-queue round trip between grpc's
C-core thread and the loop for every write (28-52 µs of CPU per message measured here, more
than the router's whole per-token budget). Here a message is a frame appended to its
connection's next write, and a write waits only when the client is behind.

What it serves: unary, server-streaming and bidirectional methods by path; the client's
`grpc-timeout` (DEADLINE_EXCEEDED when it passes); `authorize(path, metadata)` before a
handler runs (UNAUTHENTICATED); TLS with ALPN h2 and, with a CA, client certificates; several
processes on one port (SO_REUSEPORT). A malformed request (RFC 9113 8.2-8.3: an uppercase or
connection-specific field, `te` other than trailers, a pseudo-header unknown, repeated or
after a regular field, no :method, :scheme or :path) is reset with PROTOCOL_ERROR and the
connection goes on. Status codes as grpc's servers give them: UNIMPLEMENTED
for an unknown method or a compressed message, INVALID_ARGUMENT for a request that does not
parse, RESOURCE_EXHAUSTED for one over the size limit, UNKNOWN for a handler's exception.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import logging
import re
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from pdserve.router.h2 import frames as f
from pdserve.router.h2.call import AbortError, Call, CallEnded
from pdserve.router.h2.connection import Connection
from pdserve.router.h2.limits import DEFAULT_LIMITS, Limits
from pdserve.tls import TLSFiles

logger = logging.getLogger(__name__)

_TIMEOUT = re.compile(r"(\d{1,8})([HMSmun])")
_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_REQUEST_PSEUDO = {":method", ":scheme", ":path", ":authority"}
_CONNECTION_SPECIFIC = {"connection", "keep-alive", "proxy-connection", "transfer-encoding",
                        "upgrade"}


@dataclass(frozen=True)
class Method:
    kind: str  # "unary", "stream" (server streaming) or "bidi"
    handler: Callable
    parse: Callable[[bytes], Any]
    serialize: Callable[[Any], bytes]


def ssl_context(tls: TLSFiles) -> ssl.SSLContext:
    """Server TLS 1.2+ with ALPN h2; with a CA, a client certificate it signed is required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert, tls.key)
    if tls.ca:
        context.load_verify_locations(tls.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["h2"])
    return context


class GrpcServer:
    def __init__(self, methods: dict[str, Method],
                 authorize: Callable[[str, tuple], bool] | None = None,
                 limits: Limits = DEFAULT_LIMITS) -> None:
        self.methods, self.authorize, self.limits = methods, authorize, limits
        self.connections: set[Connection] = set()
        self._sockets: list[socket.socket] = []
        self._servers: list[asyncio.Server] = []

    def bind(self, host: str, port: int) -> int:
        """Bind host:port (0: a free port); the port bound. Several processes may bind the
        same port (SO_REUSEPORT): the kernel spreads connections over them."""
        self._sockets += bind_sockets(host.strip("[]"), port)
        return self._sockets[0].getsockname()[1]

    async def start(self, tls: TLSFiles | None = None) -> None:
        """Serve on the bound sockets."""
        loop = asyncio.get_running_loop()
        context = ssl_context(tls) if tls else None
        for sock in self._sockets:
            self._servers.append(await loop.create_server(
                lambda: Connection(self, self.limits), sock=sock, ssl=context, backlog=1024))

    async def stop(self, grace: float | None) -> None:
        """Take no new connections or calls; running calls get `grace` seconds, then are
        cancelled (UNAVAILABLE)."""
        for server in self._servers:
            server.close()
        for sock in self._sockets:
            sock.close()
        for conn in list(self.connections):
            conn.go_away()
        tasks = [c.task for conn in self.connections for c in conn.calls.values() if c.task]
        if tasks and grace:
            await asyncio.wait(tasks, timeout=grace)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for conn in list(self.connections):
            conn.close(f.NO_ERROR, "")

    def open_call(self, conn: Connection, stream_id: int, headers, end_stream: bool) -> None:
        """A new stream's request headers: start its call, or refuse it."""
        pseudo, metadata = {}, []
        for name, value in headers:
            name = name.decode("latin-1")
            if name.startswith(":"):
                if metadata or name not in _REQUEST_PSEUDO or name in pseudo:
                    pseudo = {}  # after a regular field, unknown, or twice: malformed
                    break
                pseudo[name] = value.decode("latin-1")
            elif name in _CONNECTION_SPECIFIC or name != name.lower() or (
                    name == "te" and value != b"trailers"):
                pseudo = {}
                break
            elif name.endswith("-bin"):
                metadata.append((name, _unbase64(value)))
            else:
                metadata.append((name, value.decode("latin-1")))
        metadata = tuple(metadata)
        meta = dict(metadata)
        if (pseudo.get(":method") != "POST" or not pseudo.get(":path")
                or not pseudo.get(":scheme")):
            # malformed (RFC 9113 8.2-8.3), or not a gRPC request: a stream error
            conn.send(f.rst_stream(stream_id, f.PROTOCOL_ERROR))
            return
        call = conn.new_call(stream_id, pseudo[":path"], metadata)
        if end_stream:
            call.close_input()
        if not str(meta.get("content-type", "")).startswith("application/grpc"):
            call.finish(grpc.StatusCode.UNKNOWN, "content-type must be application/grpc")
            return
        timeout = _TIMEOUT.fullmatch(str(meta.get("grpc-timeout", "")))
        if timeout:
            call.deadline = asyncio.get_running_loop().call_later(
                int(timeout[1]) * _UNITS[timeout[2]], _expire, call)
        call.task = asyncio.get_running_loop().create_task(self._run(call))

    async def _run(self, call: Call) -> None:
        try:
            method = self.methods.get(call.method)
            if method is None:
                call.finish(grpc.StatusCode.UNIMPLEMENTED, f"method {call.method} not found")
                return
            if self.authorize is not None and not self.authorize(call.method, call.metadata):
                call.finish(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API token "
                            "(send metadata `authorization: Bearer <token>`)")
                return
            call.serialize = method.serialize
            if method.kind == "bidi":
                result = method.handler(call.requests(method.parse), call)
            else:
                data = await call.read()
                if data is None or await call.read() is not None:
                    call.finish(grpc.StatusCode.UNIMPLEMENTED,
                                f"{call.method} takes exactly one request message")
                    return
                result = method.handler(method.parse(data), call)
            if inspect.isasyncgen(result):
                async with contextlib.aclosing(result):
                    async for response in result:
                        await call.write(response)
            else:
                response = await result
                if method.kind == "unary":
                    await call.write(response)
            call.finish(grpc.StatusCode.OK)
        except (AbortError, CallEnded):
            pass  # the status went out, or the client is gone
        except DecodeError:
            call.finish(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request is not a valid message for {call.method}")
        except asyncio.CancelledError:
            if call.expired:
                call.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            call.finish(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        except Exception as exc:
            logger.exception("%s failed", call.method)
            call.finish(grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}")
        finally:
            if call.deadline is not None:
                call.deadline.cancel()


def _expire(call: Call) -> None:
    call.expired = True
    if call.task is not None:
        call.task.cancel()


def _unbase64(value: bytes) -> bytes:
    with contextlib.suppress(ValueError):
        return base64.b64decode(value + b"=" * (-len(value) % 4))
    return value


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for every address of `host`, all on one port (the first one's when 0)."""
    sockets: list[socket.socket] = []
    try:
        seen = set()
        for family, kind, proto, _, address in socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
            if address[0] in seen:
                continue
            seen.add(address[0])
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address[0], port, *address[2:]))
            port = sock.getsockname()[1]
            sock.setblocking(False)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise ValueError(f"port: could not bind {host}:{port}: {exc}") from None
    return sockets
