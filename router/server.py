"""The router's gRPC server: pdserve.v1.Inference, grpc.health.v1.Health and reflection.

Status codes: INVALID_ARGUMENT names the field; RESOURCE_EXHAUSTED when the admission queue
is full or no decode worker finds KV room in time; UNAVAILABLE when a worker holding the
request dies or none is up, and for a new request while the service drains (`drain`);
DEADLINE_EXCEEDED past the server's own cap (`max_timeout_s`),
whatever deadline the client gave. TLS (and client certificates) when `tls` is given. The
router's own HTTP/2 front (router.h2) serves the methods, or grpc.aio's (`grpc_server`).
GetStats reports loads, never worker addresses (the worker plane is not the public's).
Health: "" and "pdserve.v1.Inference" are SERVING while at least one decode and (unless
colocated) one prefill worker are up and the router is not draining; "pdserve.redis" is
NOT_SERVING while Redis is unreachable (degraded: prefix routing and sessions are off, serving
goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Sequence
from functools import partial

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from pdserve import defaults
from pdserve.address import host_port
from pdserve.proto import pdserve_pb2, worker_pb2
from pdserve.router.admission import Overloaded, ShuttingDown
from pdserve.router.auth import APITokens, authorized, call_tenant
from pdserve.router.config import GRPC_SERVERS
from pdserve.router.grpcio_server import GrpcioServer
from pdserve.router.h2.call import CallEnded
from pdserve.router.h2.server import GrpcServer, Method
from pdserve.router.placement import NoCapacity, TTFTUnmeetable
from pdserve.router.router import Router
from pdserve.router.stream import WorkerFailed
from pdserve.router.validation import (
    DEFAULT_LIMITS,
    InvalidArgument,
    RequestLimits,
    parse_generate_request,
    validate,
)
from pdserve.router.workers import WorkerLost
from pdserve.tls import TLSFiles

logger = logging.getLogger(__name__)

SERVICE = "pdserve.v1.Inference"
REDIS_HEALTH = "pdserve.redis"
MAINTENANCE_S = 0.5
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class InferenceServicer:
    def __init__(self, router: Router, tokens: APITokens | None = None,
                 limits: RequestLimits = DEFAULT_LIMITS,
                 max_timeout_s: float = defaults.GRPC_TIMEOUT_S) -> None:
        if not max_timeout_s > 0:
            raise ValueError(f"max_timeout_s must be > 0, got {max_timeout_s}")
        self.router, self.tokens, self.limits = router, tokens, limits
        self.max_timeout_s = max_timeout_s

    async def Generate(self, request, context):
        received = time.monotonic()
        metrics = self.router.metrics
        status, budget = "error", None
        try:
            if isinstance(request, InvalidArgument):
                raise request
            tenant = call_tenant(self.tokens, context.invocation_metadata())
            if tenant is None:  # `authorized` refuses these first; never serve one regardless
                status = "invalid"
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API token")
            valid = await asyncio.to_thread(validate, request, self.router.model, self.limits,
                                            tenant)
            # one deadline for the whole call (not a timer per message)
            async with asyncio.timeout_at(_loop_time(received + self.max_timeout_s)) as budget:
                async with contextlib.aclosing(self.router.generate(valid, received)) as stream:
                    async for message in stream:
                        if not await _write(context, message):
                            status = "cancelled"
                            return
            status = "ok"
        except TimeoutError:
            if budget is None or not budget.expired():
                raise
            status = "deadline"
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the request ran past the server's limit of "
                                f"{self.max_timeout_s:g} s")
        except InvalidArgument as exc:
            status = "invalid"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TTFTUnmeetable as exc:  # gRPC's retry pushback: when to try again
            status = "overloaded"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), (
                ("grpc-retry-pushback-ms", str(math.ceil(exc.retry_after_s * 1000))),))
        except (Overloaded, NoCapacity) as exc:
            status = "overloaded"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except (WorkerLost, WorkerFailed, ShuttingDown) as exc:
            status = "unavailable"
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            metrics.count_request(status)

    async def Abort(self, request, context):
        if isinstance(request, InvalidArgument):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
        found = await self.router.abort(request.request_id)
        return pdserve_pb2.AbortResponse(found=found)

    async def GetModelInfo(self, request, context):
        model = self.router.model
        tokenizer = model.tokenizer
        return pdserve_pb2.ModelInfo(
            model=model.name, max_model_len=model.max_model_len, vocab_size=model.vocab_size,
            block_size=self.router.config.block_size, dtype=model.dtype,
            eos_token_ids=list(model.eos_token_ids),
            has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
            lora_adapters=[a.lora_name for a in model.loras or ()],
            **self._weights(),
        )

    def _weights(self) -> dict:
        """The quantization and weight bytes a decode worker reports (every worker serves the
        same weights); empty before any has reported its load."""
        for c in self.router.workers():
            if c.role == "decode" and c.load is not None and c.load.weight_bytes:
                return {"quantization": c.load.quantization, "weight_bytes": c.load.weight_bytes}
        return {}

    async def GetStats(self, request, context):
        router = self.router
        stats = pdserve_pb2.Stats(num_queued=router.admission.num_queued,
                                  num_inflight=router.admission.num_inflight,
                                  redis_up=router.store is not None and router.store.healthy)
        for c in router.workers():
            load = c.load or worker_pb2.WorkerLoad()
            stats.workers.append(pdserve_pb2.WorkerStats(  # no address: not the public's
                worker_id=c.worker_id, role=c.role, up=c.up,
                num_blocks=load.num_blocks, num_free_blocks=load.num_free_blocks,
                num_used_blocks=load.num_used_blocks, num_running=load.num_running,
                weight_bytes=load.weight_bytes,
                num_waiting=load.num_waiting, num_cached_blocks=load.num_cached_blocks,
                tp_size=load.tp_size or 1,
                num_spec_verifications=load.num_spec_verifications,
                num_draft_tokens=load.num_draft_tokens,
                num_accepted_tokens=load.num_accepted_tokens,
            ))
        return stats


async def _write(context, message) -> bool:
    """Send one message; False when the call already ended (the client went away)."""
    try:
        await context.write(message)
        return True
    except CallEnded:
        return False


def _loop_time(monotonic: float) -> float:
    """A time.monotonic() instant on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic - time.monotonic())


def _parse_abort(data: bytes):
    try:
        return pdserve_pb2.AbortRequest.FromString(data)
    except DecodeError:
        return InvalidArgument("request_id is not valid UTF-8")


def _methods(servicer: InferenceServicer, health_servicer: health.aio.HealthServicer
             ) -> dict[str, Method]:
    def unary(fn, parse) -> Method:
        return Method("unary", fn, parse, _serialize)

    reflection_servicer = reflection.aio.ReflectionServicer(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME))
    check = health_pb2.HealthCheckRequest.FromString
    return {
        f"/{SERVICE}/Generate": Method("stream", servicer.Generate, parse_generate_request,
                                       _serialize),
        f"/{SERVICE}/Abort": unary(servicer.Abort, _parse_abort),
        f"/{SERVICE}/GetModelInfo": unary(servicer.GetModelInfo,
                                          pdserve_pb2.GetModelInfoRequest.FromString),
        f"/{SERVICE}/GetStats": unary(servicer.GetStats, pdserve_pb2.GetStatsRequest.FromString),
        f"/{health.SERVICE_NAME}/Check": unary(health_servicer.Check, check),
        f"/{health.SERVICE_NAME}/Watch": Method("stream", health_servicer.Watch, check,
                                                _serialize),
        f"/{reflection.SERVICE_NAME}/ServerReflectionInfo": Method(
            "bidi", reflection_servicer.ServerReflectionInfo,
            reflection_pb2.ServerReflectionRequest.FromString, _serialize),
    }


def _serialize(message) -> bytes:
    return message.SerializeToString()


FRONTS = dict(zip(GRPC_SERVERS, (GrpcServer, GrpcioServer), strict=True))


class RouterServer:
    """The gRPC server around a Router, plus the loop that keeps health and gauges current."""

    def __init__(self, router: Router, host: str = defaults.HOST, port: int = 0,
                 api_tokens: APITokens | str | Sequence[str] | None = None, *,
                 tls: TLSFiles | None = None, limits: RequestLimits = DEFAULT_LIMITS,
                 max_timeout_s: float = defaults.GRPC_TIMEOUT_S,
                 grpc_server: str = "h2") -> None:
        """`grpc_server`: which front serves the methods, "h2" (the router's own) or
        "grpcio" (grpc.aio's server)."""
        if grpc_server not in FRONTS:
            raise ValueError(f"grpc_server must be one of {', '.join(FRONTS)}, "
                             f"got {grpc_server!r}")
        self.router = router
        tokens = APITokens.of(api_tokens)
        self.health = health.aio.HealthServicer()
        servicer = InferenceServicer(router, tokens, limits, max_timeout_s)
        self.server = FRONTS[grpc_server](
            _methods(servicer, self.health),
            authorize=partial(authorized, tokens) if tokens else None)
        self.port = self.server.bind(host, port)
        self.address = host_port(host, self.port)
        self._tls = tls
        self.tls = tls is not None  # clients need TLS (grpcs) to reach it
        self._maintenance: asyncio.Task | None = None

    async def start(self) -> None:
        await self._refresh()
        await self.server.start(self._tls)
        self._maintenance = asyncio.create_task(self._maintain(), name="router-maintenance")
        logger.info("router serving %s on %s", self.router.model.name, self.address)

    async def stop(self, grace: float = 1.0) -> None:
        if self._maintenance is not None:
            self._maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintenance
        await self.server.stop(grace)
        await self.router.close()

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(MAINTENANCE_S)
            try:
                await self._refresh()
            except Exception:  # never let a gauge update take the health loop down
                logger.exception("router maintenance failed")

    def can_serve(self) -> bool:
        """Not draining, and at least one decode and (unless colocated) one prefill worker
        are up."""
        if self.router.admission.closed:
            return False
        up = {c.role for c in self.router.workers() if c.up}
        return ({"decode"} if self.router.config.colocated else {"prefill", "decode"}) <= up

    async def drain(self, timeout_s: float) -> int:
        """Before a stop (SIGTERM): not ready from now on (health NOT_SERVING, /ready 503), a
        new request UNAVAILABLE / 503; then until the requests in flight and in line finish,
        at most `timeout_s`. How many were still in flight then."""
        self.router.admission.close()
        await self._refresh()
        return await self.router.wait_idle(timeout_s)

    async def _refresh(self) -> None:
        router, metrics = self.router, self.router.metrics
        serving = SERVING if self.can_serve() else NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, serving)
        redis_up = False
        if router.store is not None:
            redis_up = await router.store.check()
            await router.sync_loras()
        await self.health.set(REDIS_HEALTH, SERVING if redis_up else NOT_SERVING)
        metrics.set_redis_up(redis_up)
        metrics.set_queue(router.admission.num_queued, router.admission.num_inflight)
        for c in router.workers():
            load = c.load
            metrics.set_worker(c.worker_id, c.role, c.up, load.num_blocks if load else 0,
                               load.num_free_blocks if load else 0,
                               load.step_token_budget if load else 0)
            if load is not None:
                metrics.kv_tiers.set(c.worker_id, load)
            if c.role == "decode" and load is not None:  # prefill workers never speculate
                metrics.speculation.set(c.worker_id, load.num_spec_verifications,
                                        load.num_draft_tokens, load.num_accepted_tokens)
