"""GrpcioServer: the router's gRPC methods on grpc.aio's server (`--grpc-server grpcio`).

The same method table as the default front (router.h2.server.GrpcServer) and the same
interface (`bind`, `start`, `stop`), for whoever wants the gRPC front every other server runs.
What grpc's core does here instead of the router's code: HTTP/2, flow control, deadlines,
compression. The router keeps the rest alike on both fronts: `authorize(path, metadata)` runs
before the handler (UNAUTHENTICATED), a request that does not parse is INVALID_ARGUMENT, the
size limit and the stream limit come from the same `Limits`, several processes share one port
(SO_REUSEPORT), TLS with client certificates when there is a CA.
"""

from __future__ import annotations

import contextlib
import inspect
import socket
from collections.abc import Callable
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from pdserve.address import host_port
from pdserve.router.h2.limits import DEFAULT_LIMITS, Limits
from pdserve.router.h2.server import Method, bind_sockets
from pdserve.tls import TLSFiles

_HANDLERS = {"unary": grpc.unary_unary_rpc_method_handler,
             "stream": grpc.unary_stream_rpc_method_handler,
             "bidi": grpc.stream_stream_rpc_method_handler}


class GrpcioServer:
    def __init__(self, methods: dict[str, Method],
                 authorize: Callable[[str, tuple], bool] | None = None,
                 limits: Limits = DEFAULT_LIMITS) -> None:
        self.methods, self.authorize, self.limits = methods, authorize, limits
        self._address: str | None = None
        self._held: list[socket.socket] = []  # the port, held from bind until grpc listens
        self._server: grpc.aio.Server | None = None

    def bind(self, host: str, port: int) -> int:
        """Take host:port (0: a free port); the port taken. grpc listens on it at `start`
        (the credentials come then); until then this server holds it, so a port in use is
        refused here, as by the default front."""
        self._held = bind_sockets(host.strip("[]"), port)
        port = self._held[0].getsockname()[1]
        self._address = host_port(host, port)
        return port

    async def start(self, tls: TLSFiles | None = None) -> None:
        assert self._address is not None, "bind() first"
        limits = self.limits
        server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 1),
            ("grpc.max_receive_message_length", limits.max_message),
            ("grpc.max_concurrent_streams", limits.max_streams),
            ("grpc.max_metadata_size", limits.max_header_list),
        ])
        services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        for path, method in self.methods.items():
            service, name = path.lstrip("/").rsplit("/", 1)
            services.setdefault(service, {})[name] = _HANDLERS[method.kind](
                self._handler(path, method), response_serializer=method.serialize)
        server.add_generic_rpc_handlers(tuple(
            grpc.method_handlers_generic_handler(service, handlers)
            for service, handlers in services.items()))
        if tls is None:
            server.add_insecure_port(self._address)
        else:
            server.add_secure_port(self._address, _credentials(tls))
        await server.start()
        self._server = server
        for sock in self._held:  # grpc listens on the port now
            sock.close()
        self._held = []

    async def stop(self, grace: float | None) -> None:
        """Take no new calls; running calls get `grace` seconds, then are cancelled."""
        for sock in self._held:
            sock.close()
        self._held = []
        if self._server is not None:
            await self._server.stop(grace)

    def _handler(self, path: str, method: Method):
        """The method's handler on raw request bytes: authorized, then parsed as the default
        front parses them."""
        authorize, parse = self.authorize, method.parse

        async def refuse(context) -> None:
            if authorize is not None and not authorize(path, context.invocation_metadata()):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "missing or wrong API token (send metadata "
                                    "`authorization: Bearer <token>`)")

        async def parsed(data: bytes, context):
            try:
                return parse(data)
            except DecodeError:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request is not a valid message for {path}")

        if method.kind == "bidi":
            async def bidi(requests, context):
                await refuse(context)

                async def messages():
                    async for data in requests:
                        yield await parsed(data, context)

                async with contextlib.aclosing(method.handler(messages(), context)) as replies:
                    async for reply in replies:
                        yield reply
            return bidi

        async def call(data: bytes, context):
            await refuse(context)
            result = method.handler(await parsed(data, context), context)
            if inspect.isasyncgen(result):  # a streaming handler that yields its replies
                async with contextlib.aclosing(result):
                    async for reply in result:
                        await context.write(reply)
                return None
            return await result
        return call


def _credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    """The server's certificate; with a CA, clients must show a certificate it signed."""
    ca = Path(tls.ca).read_bytes() if tls.ca else None
    return grpc.ssl_server_credentials(
        [(Path(tls.key).read_bytes(), Path(tls.cert).read_bytes())],
        root_certificates=ca, require_client_auth=ca is not None)
