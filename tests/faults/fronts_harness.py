"""The router's public fronts, for real, over sockets: the real `RouterServer` (gRPC) and
OpenAI `HTTPServer` (uvicorn) around the real `Router`, whose one decode worker is the
scriptable `FakeDecode` (colocated: it prefills its own prompts), on 127.0.0.1 ports.

    async with fronts(model, tls=..., api_tokens=..., http=True) as f:
        f.address, f.http_url, f.decode, f.router
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from pdserve.cluster_secret import ClusterSecret
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai.app import OpenAIApp
from pdserve.router.openai.server import HTTPServer
from pdserve.router.router import Router
from pdserve.router.server import RouterServer
from pdserve.router.store import RedisStore
from pdserve.router.validation import DEFAULT_LIMITS, ModelContext, RequestLimits
from pdserve.tls import TLSFiles
from tests.certs import PKI
from tests.faults.router_fakes import FakeDecode, serving

READY_S = 20.0


@dataclass
class Fronts:
    router: Router
    decode: FakeDecode
    server: RouterServer
    http: HTTPServer | None

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def http_url(self) -> str:
        assert self.http is not None
        return self.http.url


@contextlib.asynccontextmanager
async def fronts(model: ModelContext, *, tls: TLSFiles | None = None,
                 api_tokens: Sequence[str] = (), store: RedisStore | None = None,
                 limits: RequestLimits = DEFAULT_LIMITS, max_timeout_s: float = 600.0,
                 http: bool = False) -> AsyncIterator[Fronts]:
    secret = ClusterSecret.generate()
    decode = FakeDecode()
    with serving(decode, secret) as decode_address:
        router = Router(model, RouterConfig(colocated=True), RouterMetrics(), store,
                        secret=secret)
        await router.add_worker("decode-0", "decode", decode_address)
        server = RouterServer(router, "127.0.0.1", 0, api_tokens, tls=tls, limits=limits,
                              max_timeout_s=max_timeout_s)
        http_server = None
        try:
            await router.wait_ready(timeout=READY_S)
            await server.start()
            if http:
                app = OpenAIApp(router, server.can_serve, api_tokens, limits=limits)
                http_server = HTTPServer(app.app, "127.0.0.1", 0, tls=tls)
                await http_server.start()
            yield Fronts(router, decode, server, http_server)
        finally:
            if http_server is not None:
                await http_server.stop()
            await server.stop(grace=0)
            await asyncio.sleep(0)


def client_ssl(pki: PKI, with_cert: bool = True) -> ssl.SSLContext:
    """An HTTPS client's context: trusts `pki`'s CA, presents its client certificate."""
    context = ssl.create_default_context(cafile=pki.ca)
    if with_cert:
        context.load_cert_chain(pki.client_cert, pki.client_key)
    return context
