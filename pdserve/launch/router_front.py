"""RouterSpec and RouterFronts: one router process's Router, gRPC front and OpenAI HTTP front.

The service process builds its router (router 0) from a RouterSpec, and every other router
process of `--router-processes` (pdserve.launch.router_processes) builds its own from the same
spec, sent to it as JSON: one builder, so every process serves alike. The spec holds what a
router needs besides the cluster secret (which travels on its own, never in a repr or a log).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pdserve.cluster_secret import ClusterSecret
from pdserve.router.config import RouterConfig
from pdserve.router.lora_adapters import parse_lora_modules
from pdserve.router.validation import RequestLimits
from pdserve.tls import TLSFiles

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterSpec:
    model_path: str
    model_name: str
    dtype: str
    max_model_len: int | None
    config: RouterConfig
    limits: RequestLimits
    host: str
    port: int  # gRPC; 0: any free port
    http_port: int  # 0: no HTTP front
    grpc_timeout_s: float
    http_timeout_s: float
    grpc_server: str  # the public gRPC front: "h2" or "grpcio"
    tls: TLSFiles | None  # the public fronts'
    worker_tls: TLSFiles | None  # the worker plane's mutual TLS
    redis_url: str = field(repr=False)  # may hold the password
    redis_namespace: str
    session_ttl_s: int
    session_max_tokens: int
    max_sessions_per_tenant: int
    redis_password: str | None = field(default=None, repr=False)
    api_tokens: tuple[str, ...] = field(default=(), repr=False)
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None  # None: chat replies' reasoning not split off
    max_lora_rank: int | None = None  # None: LoRA not enabled
    lora_modules: dict[str, str] = field(default_factory=dict)  # served from the start

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RouterSpec:
        tls = {name: TLSFiles(**data[name]) if data[name] else None
               for name in ("tls", "worker_tls")}
        return cls(**{**data, **tls, "config": RouterConfig(**data["config"]),
                      "limits": RequestLimits(**data["limits"]),
                      "api_tokens": tuple(data["api_tokens"])})


def router_spec(s, model_path: str, model_name: str, redis_url: str, tls: TLSFiles | None,
                worker_tls: TLSFiles | None, api_tokens: tuple[str, ...]) -> RouterSpec:
    """The RouterSpec of `pdserve up`'s settings `s` (a ServeSettings): every router process,
    of the pool's owner or `--router-only`, serves alike."""
    config = RouterConfig(
        block_size=s.block_size, max_inflight_requests=s.max_inflight_requests,
        max_queued_requests=s.max_queued_requests,
        kv_transfer_timeout_s=s.kv_transfer_timeout_s, outputs_silence_s=s.worker_silence_s,
        max_local_prefill_tokens=s.max_local_prefill_tokens,
        migration_limit=s.migration_limit, colocated=s.mode == "colocated",
        prefill_placement=s.prefill_placement, ttft_slo_s=s.ttft_slo_s(),
        tpot_slo_s=s.tpot_slo_s(), early_rejection=s.early_rejection,
    )
    limits = RequestLimits(s.max_stop_strings, s.max_stop_string_chars, s.max_stop_token_ids)
    return RouterSpec(
        model_path=model_path, model_name=model_name, dtype=s.dtype,
        max_model_len=s.max_model_len, config=config, limits=limits, host=s.host,
        port=s.port, http_port=s.http_port, grpc_timeout_s=s.grpc_timeout_s,
        http_timeout_s=s.http_timeout_s, grpc_server=s.grpc_server, tls=tls,
        worker_tls=worker_tls,
        redis_url=redis_url, redis_namespace=s.redis_namespace,
        session_ttl_s=s.session_ttl_s, session_max_tokens=s.session_max_tokens,
        max_sessions_per_tenant=s.max_sessions_per_token,
        redis_password=s.redis_password, api_tokens=api_tokens,
        tool_call_parser=s.tool_call_parser, reasoning_parser=s.reasoning_parser,
        max_lora_rank=s.max_lora_rank if s.lora_config() is not None else None,
        lora_modules=parse_lora_modules(s.lora_modules))


class RouterFronts:
    """A Router with its gRPC server (bound by `bind`) and, when the spec has an HTTP port,
    the OpenAI front (bound by `start`)."""

    def __init__(self, spec: RouterSpec, router, server, store, metrics) -> None:
        self.spec, self.router, self.server = spec, router, server
        self.store, self.metrics = store, metrics
        self.http = None

    @classmethod
    async def bind(cls, spec: RouterSpec, secret: ClusterSecret,
                   workers: Iterable[tuple[str, str, str]], metrics=None) -> RouterFronts:
        """Load the tokenizer, register `workers` ((worker_id, role, address) each), bind the
        gRPC port; nothing is served yet."""
        from pdserve.router.metrics import RouterMetrics
        from pdserve.router.router import Router
        from pdserve.router.server import RouterServer
        from pdserve.router.store import RedisStore
        from pdserve.router.validation import ModelContext

        model = await asyncio.to_thread(ModelContext.load, spec.model_path, spec.model_name,
                                        spec.dtype, spec.max_model_len, spec.tool_call_parser,
                                        spec.max_lora_rank, spec.lora_modules,
                                        spec.reasoning_parser)
        store = RedisStore(spec.redis_url, spec.redis_password, spec.redis_namespace,
                           session_ttl_s=spec.session_ttl_s,
                           session_max_tokens=spec.session_max_tokens,
                           max_sessions_per_tenant=spec.max_sessions_per_tenant)
        metrics = metrics if metrics is not None else RouterMetrics()
        router = Router(model, spec.config, metrics, store, secret=secret,
                        worker_tls=spec.worker_tls)
        try:
            for worker_id, role, address in workers:
                await router.add_worker(worker_id, role, address)
            server = RouterServer(router, spec.host, spec.port, spec.api_tokens, tls=spec.tls,
                                  limits=spec.limits, max_timeout_s=spec.grpc_timeout_s,
                                  grpc_server=spec.grpc_server)
        except BaseException:  # e.g. the port is taken: nothing of this router stays behind
            await router.close()
            await store.close()
            raise
        return cls(spec, router, server, store, metrics)

    async def start(self, ready_timeout_s: float, require_ready: bool = True) -> None:
        """Serve once every worker is reachable; after `ready_timeout_s` raise TimeoutError,
        or (require_ready False) serve anyway: health then says which workers are down."""
        try:
            await self.router.wait_ready(timeout=ready_timeout_s)
        except TimeoutError as exc:
            if require_ready:
                raise
            logger.warning("serving before every worker is reachable: %s", exc)
        await self.server.start()
        if self.spec.http_port:
            await self._start_http()

    async def _start_http(self) -> None:
        """The OpenAI API on the router's own event loop, calling it in-process."""
        from pdserve.router.openai.app import OpenAIApp
        from pdserve.router.openai.server import HTTPServer

        s = self.spec
        app = OpenAIApp(self.router, self.server.can_serve, s.api_tokens, s.http_timeout_s,
                        limits=s.limits)
        self.http = HTTPServer(app.app, s.host, s.http_port, tls=s.tls)
        await self.http.start()

    async def stop(self, grace: float = 1.0) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(grace)
        await self.store.close()
