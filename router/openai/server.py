"""The HTTP server of the OpenAI API: uvicorn on the router's own event loop.

It binds its socket itself (port 0 picks a free one; `port` reports it) and leaves signals to
its owner: `pdserve up` and tests stop it with `stop()`. With `tls` it serves HTTPS, and with
the TLS files' CA it requires client certificates signed by it. With `reuse_port` (SO_REUSEPORT)
every router process of a service binds the same port (`--router-processes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn

from pdserve.address import host_port
from pdserve.tls import TLSFiles

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the process owner handles SIGINT/SIGTERM, not uvicorn
        yield


class HTTPServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 tls: TLSFiles | None = None, reuse_port: bool = True) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # reuse_port: several router processes listen on one port and the kernel spreads new
        # connections over them (gRPC's own servers set SO_REUSEPORT too, by default)
        self.socket = socket.create_server((host, port), family=family, reuse_port=reuse_port)
        self.port = self.socket.getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://{host_port(host, self.port)}"
        # httptools: the C HTTP parser (h11, the pure-Python one, costs more per request).
        # A stop cuts what is still running after half a second (the last writes of a drained
        # stream): letting requests finish is the drain's job (`RouterServer.drain`).
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                http="httptools", timeout_graceful_shutdown=0.5,
                                **_ssl_options(tls))
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self.socket]),
                                         name="openai-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        logger.info("OpenAI API on %s/v1", self.url)

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await self._task
            self._task = None
        self.socket.close()


def _ssl_options(tls: TLSFiles | None) -> dict:
    if tls is None:
        return {}
    options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    if tls.ca is not None:  # mutual TLS: no handshake without a certificate the CA signed
        options.update(ssl_ca_certs=tls.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options
