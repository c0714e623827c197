"""TokenAuth: every pdserve.v1 call must carry `authorization: Bearer <api_token>`.

Health and reflection stay open (load balancers and probes carry no token). A wrong or
missing token is UNAUTHENTICATED before the call reaches the router; tokens are compared in
constant time. Off when no token is configured.
"""

from __future__ import annotations

import hmac

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("api_token must be non-empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode(), self._expected):
            return handler
        return _refusal(handler)


async def _deny(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API token "
                        "(send metadata `authorization: Bearer <token>`)")


async def _deny_stream(request, context):
    await _deny(request, context)
    yield  # pragma: no cover - never reached: abort raised


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_deny_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(_deny, **kwargs)
