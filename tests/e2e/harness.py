"""Run the real service (Redis + Ray workers + router) from a test, on a background loop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import grpc
import uvloop

from pdserve.engine.sampling_params import SamplingParams
from pdserve.launch.service import Service
from pdserve.launch.settings import ServeSettings
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

# admission limits of the package's shared service (tests/e2e/conftest.py `tiny_service`)
MAX_INFLIGHT, MAX_QUEUED = 16, 16  # 32 concurrent streams are all admitted


def tiny_settings(model_dir, ray_address: str, **overrides) -> ServeSettings:
    """Small, fast settings for the tiny test checkpoint; every port picked free. The tiny
    model's cost per token is lost in timing noise, so a placement decided from measured step
    times would be arbitrary on it: these settings keep the fixed rule (every prompt on a
    prefill worker, but a session's short tail), which the tests check; adaptive placement is
    tested where its inputs are fixed (tests/unit/test_disaggregation.py,
    tests/workers/test_adaptive_placement.py) or on SmolLM2 (tests/e2e/test_burst.py)."""
    base = ServeSettings(
        model=str(model_dir), max_model_len=512, num_kv_blocks=256, max_num_seqs=32,
        max_num_batched_tokens=512, prefill_threads=1, decode_threads=1, port=0,
        metrics_port=0, http_port=0, ray_address=ray_address, kv_transfer_timeout_s=20.0,
        router_processes=1,  # whatever the machine's cores: tests count one router's metrics
        prefill_placement="fixed",
    )
    return replace(base, **overrides)


class ServiceThread:
    """A Service started and stopped on its own event loop thread (tests are synchronous)."""

    def __init__(self, settings: ServeSettings) -> None:
        self.service = Service(settings)
        self.loop = uvloop.new_event_loop()  # as `pdserve up` runs it
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 300.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> ServiceThread:
        try:
            self.run(self.service.start())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        try:
            self.run(self.service.stop(), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    @property
    def address(self) -> str:
        return self.service.address

    @property
    def http_url(self) -> str | None:
        return self.service.http_url

    @property
    def router(self):
        return self.service.router_server.router


@contextlib.contextmanager
def running(settings: ServeSettings) -> Iterator[ServiceThread]:
    """The service up (every worker reachable) for the duration of the block."""
    service = ServiceThread(settings).start()
    try:
        yield service
    finally:
        service.stop()


def stop_process(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM (a `pdserve up` drains and stops), then SIGKILL after `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def free_port() -> int:
    """A port free now on 127.0.0.1 (for settings where 0 means off, not any)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str):
    """The first truthy value of `predicate()`, polled until `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not true within {timeout} s: {what}")


def raw_generate(address: str, payload: bytes, timeout: float = 10.0) -> grpc.RpcError:
    """Send hand-made bytes as a GenerateRequest (e.g. invalid UTF-8); the error it gets."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(
            "/pdserve.v1.Inference/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pdserve_pb2.GenerateResponse.FromString,
        )
        try:
            list(call(payload, timeout=timeout))
        except grpc.RpcError as exc:
            return exc
    raise AssertionError("the server accepted the request")


def health(address: str, service: str = "") -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def stats(address: str) -> pdserve_pb2.Stats:
    with grpc.insecure_channel(address) as channel:
        return pdserve_pb2_grpc.InferenceStub(channel).GetStats(pdserve_pb2.GetStatsRequest(),
                                                                timeout=5)


def token_prompts(n: int, seed: int) -> list[list[int]]:
    """`n` prompts of 12-16 token ids, different for each seed."""
    return [[(seed * 131 + i * 17 + k * 7) % 4000 + 3 for k in range(12 + i % 5)]
            for i in range(n)]


def offline_greedy(offline, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """What the offline `LLM` generates for each prompt, greedy, `max_tokens` each."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.token_ids) for o in offline.generate(prompts, params)]


async def greedy_stream(channel: grpc.aio.Channel, request_id: str, prompt: list[int],
                        max_tokens: int, started: asyncio.Event | None = None,
                        metadata: tuple = ()) -> tuple[str, list[int]]:
    """One greedy Generate: ("length", tokens), or the gRPC status name and the tokens
    before it; `started` is set at the first message."""
    sampling = pdserve_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request = pdserve_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                          sampling=sampling)
    tokens, reason = [], ""
    try:
        async for message in pdserve_pb2_grpc.InferenceStub(channel).Generate(
                request, timeout=120, metadata=metadata):
            tokens.extend(message.token_ids)
            reason = message.finish_reason or reason
            if started is not None:
                started.set()
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, tokens
    return reason, tokens
