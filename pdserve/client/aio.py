"""AsyncClient: the asyncio twin of `sync.Client`, over grpc.aio."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import defaults
from pdserve.client.messages import (
    Completion,
    GenerateChunk,
    build_request,
    chunk_from_proto,
    collect,
)
from pdserve.client.rpc import (
    POLL_S,
    ClientTLS,
    PdserveError,
    auth_metadata,
    error_from,
    not_ready,
    open_channel,
    status_name,
)
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

logger = logging.getLogger(__name__)


class AsyncClient:
    """The same API as Client over grpc.aio: `generate` is an async iterator, the rest awaits."""

    def __init__(self, address: str = defaults.ROUTER_ADDRESS, timeout: float | None = None,
                 api_token: str | None = None, tls: ClientTLS | None = None,
                 connections: int = 1) -> None:
        """`connections` > 1: that many TCP connections, Generate streams taking turns over
        them, so a service with several router processes serves this client with all."""
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        self.address = address
        self.timeout = timeout
        self._metadata = auth_metadata(api_token)
        self._channels = [open_channel(address, tls, aio=True, own_connection=connections > 1)
                          for _ in range(connections)]
        self._channel = self._channels[0]
        self._stub = pdserve_pb2_grpc.InferenceStub(self._channel)
        self._stream_stubs = itertools.cycle(
            [pdserve_pb2_grpc.InferenceStub(c) for c in self._channels])
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Sequence[dict] | None = None, sampling: SamplingParams | None = None,
                 session_id: str = "", request_id: str = "", model: str = "",
                 tools: Sequence[dict] | None = None, tool_choice: str | None = None,
                 chat_template_kwargs: dict | None = None,
                 timeout: float | None = None) -> AsyncIterator[GenerateChunk]:
        """Streams the answer; the RPC starts at the first `anext` and is cancelled on exit."""
        request = build_request(prompt, messages=messages, sampling=sampling,
                                session_id=session_id, request_id=request_id, model=model,
                                tools=tools, tool_choice=tool_choice,
                                chat_template_kwargs=chat_template_kwargs)
        return self._stream(request, self._deadline(timeout))

    async def complete(self, prompt: str | Sequence[int] | None = None,
                       **kwargs: Any) -> Completion:
        """Runs `generate` (same arguments) to the end."""
        async with contextlib.aclosing(self.generate(prompt, **kwargs)) as stream:
            return collect([chunk async for chunk in stream])

    async def abort(self, request_id: str, timeout: float | None = None) -> bool:
        request = pdserve_pb2.AbortRequest(request_id=request_id)
        return (await self._unary(self._stub.Abort, request, timeout)).found

    async def model_info(self, timeout: float | None = None) -> pdserve_pb2.ModelInfo:
        request = pdserve_pb2.GetModelInfoRequest()
        return await self._unary(self._stub.GetModelInfo, request, timeout)

    async def stats(self, timeout: float | None = None) -> pdserve_pb2.Stats:
        return await self._unary(self._stub.GetStats, pdserve_pb2.GetStatsRequest(), timeout)

    async def health(self, timeout: float | None = None) -> str:
        request = health_pb2.HealthCheckRequest(service="")
        return status_name(await self._unary(self._health.Check, request, timeout))

    async def wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        last = "no answer"
        while (left := end - time.monotonic()) > 0:
            try:
                last = await self.health(timeout=min(left, 1.0))
            except PdserveError as e:
                last = e.code.name
            if last == "SERVING":
                return
            await asyncio.sleep(min(POLL_S, max(end - time.monotonic(), 0.0)))
        raise not_ready(self.address, timeout, last)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(request, timeout=self._deadline(timeout),
                                metadata=self._metadata)
        except grpc.RpcError as e:
            raise error_from(e) from e

    async def _stream(self, request: pdserve_pb2.GenerateRequest,
                      timeout: float | None) -> AsyncIterator[GenerateChunk]:
        call = next(self._stream_stubs).Generate(request, timeout=timeout,
                                                 metadata=self._metadata)
        try:
            async for msg in call:
                yield chunk_from_proto(msg)
        except grpc.RpcError as e:
            raise error_from(e) from e
        finally:
            # Runs on break (via the loop's async-generator finalizer), aclose() and task
            # cancellation: the router frees the request now.
            if call.cancel():
                logger.debug("cancelled Generate %r", request.request_id)
