"""Client: the blocking client over one gRPC channel (`aio.AsyncClient` is its asyncio twin)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
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


class Client:
    """Blocking client over one gRPC channel; `timeout` is the default deadline of every call."""

    def __init__(self, address: str = defaults.ROUTER_ADDRESS, timeout: float | None = None,
                 api_token: str | None = None, tls: ClientTLS | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = auth_metadata(api_token)
        self._channel = open_channel(address, tls)
        self._stub = pdserve_pb2_grpc.InferenceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Sequence[dict] | None = None, sampling: SamplingParams | None = None,
                 session_id: str = "", request_id: str = "", model: str = "",
                 tools: Sequence[dict] | None = None, tool_choice: str | None = None,
                 chat_template_kwargs: dict | None = None,
                 timeout: float | None = None) -> Iterator[GenerateChunk]:
        """Streams the answer; the RPC starts at the first `next` and is cancelled on exit."""
        request = build_request(prompt, messages=messages, sampling=sampling,
                                session_id=session_id, request_id=request_id, model=model,
                                tools=tools, tool_choice=tool_choice,
                                chat_template_kwargs=chat_template_kwargs)
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
        return status_name(self._unary(self._health.Check, request, timeout))

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
            time.sleep(min(POLL_S, max(end - time.monotonic(), 0.0)))
        raise not_ready(self.address, timeout, last)

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
            raise error_from(e) from e

    def _stream(self, request: pdserve_pb2.GenerateRequest,
                timeout: float | None) -> Iterator[GenerateChunk]:
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            for msg in call:
                yield chunk_from_proto(msg)
        except grpc.RpcError as e:
            raise error_from(e) from e
        finally:
            # Runs on break, close() and garbage collection: the router frees the request now.
            if call.cancel():
                logger.debug("cancelled Generate %r", request.request_id)
