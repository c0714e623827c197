"""The OpenAI-compatible HTTP API of a router (Starlette), calling the router in-process.

    GET  /v1/models               the served model, and its LoRA adapters (with `parent`)
    POST /v1/completions          text or token-id prompts (one or several), n choices each
    POST /v1/chat/completions     messages, under the model's chat template
    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}: serve one more adapter
    POST /v1/unload_lora_adapter  {"lora_name"}: stop serving it (requests in flight finish)
    GET  /health                  liveness: 200 while the process serves HTTP
    GET  /ready                   readiness: 200 when the router can serve, else 503
    GET  /metrics                 the router's Prometheus metrics

Validation is the gRPC front's (`router.validation.validate`), with its field names mapped to
OpenAI's parameters. Session affinity: the `X-Session-Id` header or a `session_id` body field.
With API tokens set, /v1/* needs `Authorization: Bearer <token>` (the rest stays open, as
probes and scrapers need); each token's session ids are its own (`router.auth`). A
client-given `timeout` (seconds) is capped by the server's, stop lists by `RequestLimits`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve.redis_keys import PUBLIC_TENANT
from pdserve.router.auth import APITokens
from pdserve.router.openai.errors import HTTPError, error_body
from pdserve.router.openai.generation import GenerationResponse
from pdserve.router.openai.protocol import (
    BadParameter,
    OpenAIRequest,
    choices,
    parse_chat,
    parse_completion,
)
from pdserve.router.openai.responses import Choices, TokenTexts
from pdserve.router.router import Router
from pdserve.router.validation import DEFAULT_LIMITS, InvalidArgument, RequestLimits, validate

MAX_BODY_BYTES = 8 << 20
DEFAULT_TIMEOUT_S = 600.0


class OpenAIApp:
    def __init__(self, router: Router, ready: Callable[[], bool],
                 api_tokens: APITokens | str | Sequence[str] | None = None,
                 max_timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_body_bytes: int = MAX_BODY_BYTES,
                 limits: RequestLimits = DEFAULT_LIMITS) -> None:
        self.router, self.ready = router, ready
        self.tokens = APITokens.of(api_tokens)
        self.max_timeout_s, self.max_body_bytes = max_timeout_s, max_body_bytes
        self.limits = limits
        self.texts = TokenTexts(router.model.tokenizer)
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.readiness, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], exception_handlers={HTTPError: _http_error})

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        model = self.router.model
        card = {"object": "model", "created": self.created, "owned_by": "pdserve",
                "max_model_len": model.max_model_len}
        adapters = [{**card, "id": a.lora_name, "root": a.lora_path, "parent": model.name}
                    for a in model.loras or ()]
        return JSONResponse({"object": "list", "data": [
            {**card, "id": model.name, "root": model.name, "parent": None}, *adapters]})

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's: serve the PEFT adapter at `lora_path` as `lora_name` (checked first)."""
        body = await self._lora_body(request)
        await self._change_loras(self.router.load_lora(body.get("lora_name"),
                                                       body.get("lora_path")))
        return Response(f"Success: LoRA adapter {body['lora_name']!r} added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        body = await self._lora_body(request)
        if self.router.model.loras.get(body.get("lora_name")) is None:
            raise HTTPError(404, f"lora_name: no adapter {body.get('lora_name')!r} is loaded",
                            "lora_name")
        await self._change_loras(self.router.unload_lora(body.get("lora_name")))
        return Response(f"Success: LoRA adapter {body['lora_name']!r} removed successfully.")

    async def _lora_body(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        if self.router.model.loras is None:
            raise HTTPError(400, "LoRA is not enabled on this server (--enable-lora)")
        body = await self._body(request)
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        return body

    @staticmethod
    async def _change_loras(change: Awaitable[Any]) -> None:
        """Await the router's change of its adapters; a ValueError is a 400 naming the field
        (lora_name, lora_path)."""
        try:
            await change
        except ValueError as exc:
            message = str(exc)
            field = "lora_path" if message.startswith("lora_path") else "lora_name"
            raise HTTPError(400, message, field) from None

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def readiness(self, request: Request) -> Response:
        ready = self.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.router.metrics.render(),
                        media_type=CONTENT_TYPE_LATEST)

    async def _generate(self, request: Request, parse: Callable[..., OpenAIRequest]) -> Any:
        tenant = self._authorize(request)
        received = time.monotonic()
        try:
            parsed = parse(await self._body(request), request.headers.get("x-session-id", ""))
            try:
                self.router.model.lora(parsed.model)
            except InvalidArgument as exc:
                raise HTTPError(404, str(exc), "model") from None
            valid = await asyncio.to_thread(self._validate, parsed, tenant)
        except (InvalidArgument, HTTPError) as exc:
            self.router.metrics.count_request("invalid")
            status = exc.status if isinstance(exc, HTTPError) else 400
            return JSONResponse(error_body(status, exc), status_code=status)
        timeout = min(parsed.timeout_s or self.max_timeout_s, self.max_timeout_s)
        answer = Choices(parsed, parsed.model or self.router.model.name, self.texts,
                         self.router.model.tool_call_parser,
                         [v.prompt_token_ids for v in valid[::parsed.n]],
                         self.router.model.reasoning_parser,
                         [v.reasoning_mode for v in valid[::parsed.n]])
        return GenerationResponse(
            parsed, lambda: [self.router.generate(v, received) for v in valid], answer,
            timeout, self.router.metrics.count_request)

    def _validate(self, parsed: OpenAIRequest, tenant: str) -> list:
        """Every choice's router request: each prompt validated and tokenized once."""
        model = self.router.model
        try:
            return [choice for r in parsed.requests
                    for choice in choices(validate(r, model, self.limits, tenant), parsed.n)]
        except InvalidArgument as exc:
            raise BadParameter.from_router(exc, parsed.max_tokens_param, parsed.prompt_param,
                                           parsed.structured_param) from None

    async def _body(self, request: Request) -> Any:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise HTTPError(413, f"the request body is over {self.max_body_bytes} bytes")
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadParameter("body", f"the request body is not valid JSON: {exc}") from None

    def _authorize(self, request: Request) -> str:
        """The caller's tenant; HTTPError 401 without a valid token (when tokens are set)."""
        if self.tokens is None:
            return PUBLIC_TENANT
        tenant = self.tokens.tenant(request.headers.get("authorization", ""))
        if tenant is None:
            raise HTTPError(401, "missing or invalid API key: send Authorization: Bearer <key>")
        return tenant


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPError)
    return JSONResponse(error_body(exc.status, exc), status_code=exc.status)
