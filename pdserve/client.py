"""Client and AsyncClient: the Python face of the router's public gRPC API (proto/pdserve.proto).

`generate` streams `GenerateChunk`s; `complete` runs a stream to the end. Leaving a stream early
(break, `close()`, garbage collection, task cancellation) cancels the RPC, so the router frees
the request's KV blocks at once instead of generating into the void. gRPC failures surface as
`PdserveError`, which keeps the status code (INVALID_ARGUMENT vs RESOURCE_EXHAUSTED ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import TokenLogprobs
from pdserve.engine.wire import logprobs_from_proto, sampling_to_proto
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1:50051"
# Reconnect within a second after a router restart, not after gRPC's default backoff (<= 120 s).
_CHANNEL_OPTIONS = (("grpc.max_reconnect_backoff_ms", 1000),)
_POLL_S = 0.1  # wait_ready: pause between health checks


class PdserveError(Exception):
    """A failed RPC: `code` is the grpc.StatusCode, `message` the server's details."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from a prefix cache


@dataclass(frozen=True)
class Timings:
    queue_s: float  # waiting for admission
    ttft_s: float  # request received -> first token sent
    e2e_s: float  # request received -> last message


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed message: the new text and tokens since the previous chunk.

    finish_reason ("stop" | "length" | "abort"), usage and timings come on the last chunk only.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None


@dataclass(frozen=True)
class Completion:
    """A whole answer: what `complete` returns."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None
    stop_reason: str | None
    usage: Usage | None
    timings: Timings | None


def build_request(
    prompt: str | Sequence[int] | None = None, *, messages: Sequence[dict] | None = None,
    sampling: SamplingParams | None = None, session_id: str = "", request_id: str = "",
    model: str = "",
) -> pdserve_pb2.GenerateRequest:
    """The GenerateRequest; with `sampling` None no sampling field is sent (server defaults)."""
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt (text or token ids) and messages")
    request = pdserve_pb2.GenerateRequest(request_id=request_id, session_id=session_id,
                                          model=model)
    if isinstance(prompt, str):
        request.prompt = prompt
    elif prompt is not None:
        request.prompt_token_ids.extend(int(t) for t in prompt)
    else:
        for m in messages:  # type: ignore[union-attr]
            request.messages.add(role=m["role"], content=m["content"])
    if sampling is not None:
        request.sampling.CopyFrom(sampling_to_proto(sampling))
    return request


def chunk_from_proto(msg: pdserve_pb2.GenerateResponse) -> GenerateChunk:
    usage = timings = None
    if msg.HasField("usage"):
        u = msg.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
    if msg.HasField("timings"):
        t = msg.timings
        timings = Timings(t.queue_s, t.ttft_s, t.e2e_s)
    return GenerateChunk(
        request_id=msg.request_id, text=msg.text, token_ids=tuple(msg.token_ids),
        logprobs=tuple(logprobs_from_proto(lp) for lp in msg.logprobs),
        finish_reason=msg.finish_reason or None, stop_reason=msg.stop_reason or None,
        usage=usage, timings=timings,
    )


def collect(chunks: Iterable[GenerateChunk]) -> Completion:
    """Joins a stream's chunks; the final fields come from the last chunk."""
    chunks = list(chunks)
    last = chunks[-1] if chunks else GenerateChunk("", "", ())
    return Completion(
        request_id=last.request_id, text="".join(c.text for c in chunks),
        token_ids=tuple(t for c in chunks for t in c.token_ids),
        logprobs=tuple(lp for c in chunks for lp in c.logprobs),
        finish_reason=last.finish_reason, stop_reason=last.stop_reason,
        usage=last.usage, timings=last.timings,
    )


def _error(exc: grpc.RpcError) -> PdserveError:
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    return PdserveError(code or grpc.StatusCode.UNKNOWN, details or "")


def _status_name(response: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def _not_ready(address: str, timeout: float, last: str) -> TimeoutError:
    return TimeoutError(f"pdserve at {address} not SERVING after {timeout:g} s (last: {last})")


class Client:
    """Blocking client over one gRPC channel; `timeout` is the default deadline of every call."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float | None = None,
                 api_token: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {api_token}"),) if api_token else ()
        self._channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = pdserve_pb2_grpc.InferenceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Sequence[dict] | None = None, sampling: SamplingParams | None = None,
                 session_id: str = "", request_id: str = "", model: str = "",
                 timeout: float | None = None) -> Iterator[GenerateChunk]:
        """Streams the answer; the RPC starts at the first `next` and is cancelled on exit."""
        request = build_request(prompt, messages=messages, sampling=sampling,
                                session_id=session_id, request_id=request_id, model=model)
        return self._stream(request, self._deadline(timeout))

    def complete(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Completion:
        """Runs `generate` (same arguments) to the end."""
        with contextlib.closing(self.generate(prompt, **kwargs)) as stream:
            return collect(stream)

    def abort(self, request_id: str, timeout: float | None = None) -> bool:
        """True when the router knew the request (it is ended and its blocks freed)."""
        request = pdserve_pb2.AbortRequest(request_id=request_id)
        return self._unary(self._stub.Abort, request, timeout).found

    def model_info(self, timeout: float | None = None) -> pdserve_pb2.ModelInfo:
        return self._unary(self._stub.GetModelInfo, pdserve_pb2.GetModelInfoRequest(), timeout)

    def stats(self, timeout: float | None = None) -> pdserve_pb2.Stats:
        return self._unary(self._stub.GetStats, pdserve_pb2.GetStatsRequest(), timeout)

    def health(self, timeout: float | None = None) -> str:
        """The standard health status of the server ("" service): "SERVING", "NOT_SERVING"..."""
        request = health_pb2.HealthCheckRequest(service="")
        return _status_name(self._unary(self._health.Check, request, timeout))

    def wait_ready(self, timeout: float) -> None:
        """Polls health until SERVING; TimeoutError (naming the address) after `timeout` s."""
        end = time.monotonic() + timeout
        last = "no answer"
        while (left := end - time.monotonic()) > 0:
            try:
                last = self.health(timeout=min(left, 1.0))
            except PdserveError as e:
                last = e.code.name
            if last == "SERVING":
                return
            time.sleep(min(_POLL_S, max(end - time.monotonic(), 0.0)))
        raise _not_ready(self.address, timeout, last)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(request, timeout=self._deadline(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from e

    def _stream(self, request: pdserve_pb2.GenerateRequest,
                timeout: float | None) -> Iterator[GenerateChunk]:
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            for msg in call:
                yield chunk_from_proto(msg)
        except grpc.RpcError as e:
            raise _error(e) from e
        finally:
            # Runs on break, close() and garbage collection: the router frees the request now.
            if call.cancel():
                logger.debug("cancelled Generate %r", request.request_id)


class AsyncClient:
    """The same API as Client over grpc.aio: `generate` is an async iterator, the rest awaits."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float | None = None,
                 api_token: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {api_token}"),) if api_token else ()
        self._channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = pdserve_pb2_grpc.InferenceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Sequence[dict] | None = None, sampling: SamplingParams | None = None,
                 session_id: str = "", request_id: str = "", model: str = "",
                 timeout: float | None = None) -> AsyncIterator[GenerateChunk]:
        """Streams the answer; the RPC starts at the first `anext` and is cancelled on exit."""
        request = build_request(prompt, messages=messages, sampling=sampling,
                                session_id=session_id, request_id=request_id, model=model)
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
        return _status_name(await self._unary(self._health.Check, request, timeout))

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
            await asyncio.sleep(min(_POLL_S, max(end - time.monotonic(), 0.0)))
        raise _not_ready(self.address, timeout, last)

    async def close(self) -> None:
        await self._channel.close()

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
            raise _error(e) from e

    async def _stream(self, request: pdserve_pb2.GenerateRequest,
                      timeout: float | None) -> AsyncIterator[GenerateChunk]:
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            async for msg in call:
                yield chunk_from_proto(msg)
        except grpc.RpcError as e:
            raise _error(e) from e
        finally:
            # Runs on break (via the loop's async-generator finalizer), aclose() and task
            # cancellation: the router frees the request now.
            if call.cancel():
                logger.debug("cancelled Generate %r", request.request_id)
