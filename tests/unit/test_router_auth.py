"""The router's API-token check in front of the real gRPC fronts (the router's own and
grpc.aio's), isolated from the router itself: stand-in handlers answer."""

from __future__ import annotations

import pytest

from pdserve.router.server import FRONTS


@pytest.mark.parametrize("front", sorted(FRONTS))
def test_api_token_is_required_when_configured(front):
    """`authorized` in front of a real gRPC front over a socket: pdserve.v1 needs the token,
    health stays open."""
    import asyncio
    from functools import partial

    from grpc_health.v1 import health, health_pb2

    from pdserve.client import AsyncClient, PdserveError
    from pdserve.proto import pdserve_pb2
    from pdserve.router.auth import APITokens, authorized
    from pdserve.router.h2.server import Method

    async def get_stats(request, context):
        return pdserve_pb2.Stats(num_queued=7)

    async def generate(request, context):
        yield pdserve_pb2.GenerateResponse(text="ok", finish_reason="length")

    def serialize(message):
        return message.SerializeToString()

    async def run():
        checker = health.aio.HealthServicer()
        service = "/pdserve.v1.Inference"
        server = FRONTS[front]({
            f"{service}/GetStats": Method("unary", get_stats,
                                          pdserve_pb2.GetStatsRequest.FromString, serialize),
            f"{service}/Generate": Method("stream", generate,
                                          pdserve_pb2.GenerateRequest.FromString, serialize),
            "/grpc.health.v1.Health/Check": Method(
                "unary", checker.Check, health_pb2.HealthCheckRequest.FromString, serialize),
        }, authorize=partial(authorized, APITokens.of("s3cret")))
        port = server.bind("127.0.0.1", 0)
        await server.start()
        address = f"127.0.0.1:{port}"
        try:
            codes = []
            for token in (None, "wrong", "s3cret"):
                async with AsyncClient(address, timeout=5, api_token=token) as client:
                    try:
                        stats = await client.stats()
                        text = (await client.complete("hi")).text
                        codes.append(("OK", stats.num_queued, text))
                    except PdserveError as exc:
                        codes.append((exc.code.name,))
            async with AsyncClient(address, timeout=5) as client:  # probes need no token
                health_status = await client.health()
            return codes, health_status
        finally:
            await server.stop(0)

    codes, health_status = asyncio.run(run())
    assert codes == [("UNAUTHENTICATED",), ("UNAUTHENTICATED",), ("OK", 7, "ok")]
    assert health_status == health_pb2.HealthCheckResponse.ServingStatus.Name(
        health_pb2.HealthCheckResponse.SERVING)


def test_api_tokens_name_each_caller_s_tenant():
    from pdserve.redis_keys import PUBLIC_TENANT
    from pdserve.router.auth import APITokens, call_tenant, tenant_of

    tokens = APITokens(["alpha", "beta"])
    assert tokens.tenant("Bearer alpha") == tenant_of("alpha")
    assert tokens.tenant("bearer beta") == tenant_of("beta")
    assert tenant_of("alpha") != tenant_of("beta") and "alpha" not in tenant_of("alpha")
    for header in ("Bearer gamma", "Basic alpha", "alpha", "Bearer ", ""):
        assert tokens.tenant(header) is None
    assert call_tenant(None, ()) == PUBLIC_TENANT  # an open API: one shared tenant
    assert call_tenant(tokens, (("authorization", "Bearer beta"),)) == tenant_of("beta")
    assert call_tenant(tokens, ()) is None
    assert APITokens.of(None) is None and APITokens.of(()) is None
    assert APITokens.of("alpha").tenant("Bearer alpha") == tenant_of("alpha")
    with pytest.raises(ValueError):
        APITokens(["alpha", ""])
