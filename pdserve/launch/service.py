"""Service: everything `pdserve up` runs — Redis, Ray workers, the router, metrics, supervision.

Embedded default: a bundled redis-server, a local Ray head, 1 prefill + 1 decode worker on
the bundled SmolLM2, the router on 127.0.0.1:50051 and metrics on 127.0.0.1:9400 (see
`pdserve.defaults`); with `router_processes` N > 1, N-1 more router processes share its
ports and workers (pdserve.launch.router_processes). The worker table is published in Ray's
GCS (pdserve.launch.registry) for routers on other machines (`pdserve up --router-only`,
pdserve.launch.router_only). Point `ray_address` / `redis_url` elsewhere and the same code runs
against a real cluster.
`drain()` (SIGTERM) lets the requests in flight finish first; `stop()` stops exactly what
`start()` started.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve import cluster_secret, defaults
from pdserve.cluster_secret import ClusterSecret
from pdserve.launch.settings import ServeSettings

logger = logging.getLogger(__name__)

STOP_PART_S = 30.0  # the longest one part of the service may take to stop


class Service:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.redis = None  # the bundled server, when we started one
        self.pool = None
        self.store = None
        self.router_server = None
        self.http = None  # the OpenAI-compatible front, when http_port is set
        self.router_processes = None  # routers 1..N-1, when router_processes > 1
        self.registry = None  # the worker table, published for --router-only routers
        self.metrics = None
        self.metrics_port: int | None = None
        self._supervisor: asyncio.Task | None = None
        self._planner: asyncio.Task | None = None
        self._started_ray = False
        self._policy = None
        # the worker plane's secret: the operator's (e.g. a Kubernetes Secret) or a fresh one;
        # it reaches workers through their environment only, never argv or a log line
        self.secret = _cluster_secret()
        # read (and checked) now: a missing certificate or token file fails before Ray starts
        self.tls = settings.tls()
        self.worker_tls = settings.cluster_tls()  # the worker plane's mTLS, or None
        self.api_tokens = settings.api_tokens()
        if (settings.planner_policy is None) != (settings.planner_perf is None):
            raise ValueError("planner_policy and planner_perf go together: the policy's "
                             "sizing needs the workers' measured performance")
        if settings.planner_policy is not None:
            from pdserve.planner.policy import load_policy

            self._policy = load_policy(settings.planner_policy)

    @property
    def address(self) -> str:
        return self.router_server.address

    @property
    def http_url(self) -> str | None:
        """Base URL of the OpenAI API (`.../v1` is under it), or None when it is off."""
        return None if self.http is None else self.http.url

    async def start(self) -> None:
        from pdserve.engine.default_model import resolve_model

        s = self.settings
        model_path = str(await asyncio.to_thread(resolve_model, s.model))
        model_name = s.model if not Path(s.model).is_dir() else Path(s.model).name
        self._start_ray()  # on this thread: Ray's driver wants the main thread
        redis_url = s.redis_url or await asyncio.to_thread(self._start_redis)
        self.pool = self._make_pool(model_path, model_name, redis_url)
        infos = await asyncio.to_thread(self.pool.start)
        await self._start_router(model_path, model_name, redis_url, infos)

    async def drain(self, timeout_s: float) -> int:
        """Before `stop` (SIGTERM): see `drain_routers`."""
        return await drain_routers(self.router_server, self.router_processes, timeout_s)

    async def stop(self) -> None:
        """Stop what was started, front to back. Each part gets STOP_PART_S: one that hangs is
        logged by name and left behind, and the parts after it still stop."""
        tasks = [t for t in (self._planner, self._supervisor) if t is not None]
        for task in tasks:
            task.cancel()
        parts = [
            ("planner and supervisor", lambda: asyncio.gather(*tasks, return_exceptions=True)),
            ("worker registry", self.registry and self.registry.close),
            ("other router processes", self.router_processes and self.router_processes.stop),
            ("OpenAI front", self.http and self.http.stop),
            ("router", self.router_server and self.router_server.stop),
            ("metrics server", self.metrics and as_coroutine(self.metrics.stop_http)),
            ("Redis store", self.store and self.store.close),
            ("worker pool", self.pool and (lambda: asyncio.to_thread(self.pool.shutdown))),
            ("Ray", self._started_ray and as_coroutine(_stop_ray)),
            ("bundled Redis", self.redis and as_coroutine(self.redis.stop)),
        ]
        for name, stop in parts:
            if stop:
                await stop_part(name, stop)

    def _start_redis(self) -> str:
        """The bundled redis-server, where every worker can reach it and no further: loopback
        when workers bind loopback (whatever `host` the router binds), else this node's
        address. Always with a password (the given one, else a generated one): other local
        users reach loopback too."""
        from pdserve.launch.redis_server import RedisServer

        s = self.settings
        host, password = defaults.HOST, s.redis_password or secrets.token_urlsafe(24)
        if s.worker_host not in defaults.LOOPBACK_HOSTS:
            import ray

            host = ray.util.get_node_ip_address() if s.worker_host == "auto" else s.worker_host
        self.redis = RedisServer(host=host, password=password,
                                 max_memory_bytes=s.redis_max_memory_bytes)
        self.redis.start()
        logger.info("started redis-server on %s:%d", self.redis.host, self.redis.port)
        return self.redis.url

    def _start_ray(self) -> None:
        """Join (or start) Ray, unless this process already has; then check that the router can
        reach the workers on every node (`unreachable_worker_host`)."""
        import ray

        from pdserve.launch.ray_runtime import node_addresses, start_ray, unreachable_worker_host

        s = self.settings
        if not ray.is_initialized():
            most = {"prefill": self._num_prefill, "decode": s.decode_workers}
            if self._policy is not None:  # room for the planner's largest pools
                most = {role: max(n, self._policy.bounds(role)[1]) for role, n in most.items()}
            need = most["prefill"] * self._threads("prefill") + (
                most["decode"] * s.decode_tp * self._threads("decode"))
            start_ray(s.ray_address, resources=most,
                      num_cpus=max(os.cpu_count() or 1, need), tmpdir=None)
            self._started_ray = True
        problem = unreachable_worker_host(s.worker_host, node_addresses())
        if problem is not None:  # before any worker starts where the router can't reach it
            raise ValueError(problem)

    @property
    def _num_prefill(self) -> int:
        return 0 if self.settings.mode == "colocated" else self.settings.prefill_workers

    def _step_policy(self, role: str) -> dict[str, Any]:
        """A prefill worker's steps sized in time and its queue order. A decode worker keeps
        arrival order and its token budget, but under a TPOT SLO a step that prefills a
        prompt beside the batch's decodes is sized to last about half the bound (Sarathi's
        stall-free chunks): a request whose every step carries a chunk still meets it, with
        room for timing noise. (Sized to the whole bound, the pd_vs_colocated grid's TPOT p50
        sat at the bound under load, and half its requests missed it.)"""
        s = self.settings
        if role != "prefill":
            tpot = s.tpot_slo_s()
            return {"step_target_s": tpot / 2 if tpot else None}
        return {"step_target_s": s.prefill_step_ms / 1e3 or None,
                "scheduling_policy": s.scheduling_policy}

    def _threads(self, role: str) -> int:
        """Unless given: decode ranks split all the cores, prefill workers split them with every
        other worker process (2 + 1 on 2 cores; a lone colocated worker gets them all). Decode
        runs every step while prefill runs in bursts, so a core that only a prefill worker
        would use sits idle between them. Measured on 2 cores (`pdserve bench --workload
        sharegpt --num-requests 32 --concurrency 16`, 3 runs each, one after the other):
        decode on 2 threads TPOT p50 56/50/52 ms, 172-203 tok/s; on 1 thread 59/55/56 ms,
        171-204 tok/s. TTFT the same; 2 + 2 was no better than 1 + 2 and noisier."""
        given = getattr(self.settings, f"{role}_threads")
        s = self.settings
        cores = os.cpu_count() or 2
        if role == "decode":
            return given or max(1, cores // (s.decode_workers * s.decode_tp))
        return given or max(1, cores // (self._num_prefill + s.decode_workers * s.decode_tp))

    def _make_pool(self, model_path: str, model_name: str, redis_url: str):
        from pdserve.engine.spec.config import parse_speculative_config
        from pdserve.engine.spec.make import sized
        from pdserve.launch.pool import WorkerPool
        from pdserve.launch.redis_server import split_password
        from pdserve.worker_spec import WorkerSpec

        s = self.settings
        redis_url, redis_password = split_password(redis_url, s.redis_password)
        # a worker caps reservations above the router's transfer deadline, and a TP group's
        # collectives above a reservation (a follower waits for its KV inside one)
        reservation_s = max(60.0, 2 * s.kv_transfer_timeout_s)
        # mTLS paths, absolute: a Ray worker's working directory is not ours
        tls = {} if self.worker_tls is None else {
            f"tls_{name}": os.path.abspath(getattr(self.worker_tls, name))
            for name in ("cert", "key", "ca")}
        # each worker's KV tiers; the disk path absolute, as the mTLS paths
        tiers = s.kv_tiers()
        if tiers["kv_disk_path"] is not None:
            tiers["kv_disk_path"] = os.path.abspath(tiers["kv_disk_path"])
        # only the workers that decode speculate (colocated ones are decode workers too)
        parsed = parse_speculative_config(s.speculative_config)
        speculative = None if parsed is None else parsed.to_dict()

        def spec(worker_id: str, role: str) -> WorkerSpec:
            return WorkerSpec(
                worker_id=worker_id, model=model_path, model_name=model_name, dtype=s.dtype,
                max_model_len=s.max_model_len, block_size=s.block_size,
                kv_cache_memory_bytes=s.kv_cache_memory_bytes, num_kv_blocks=s.num_kv_blocks,
                kv_cache_dtype=s.kv_cache_dtype, enable_prefix_caching=s.enable_prefix_caching,
                quantization=s.quantization, quantization_group_size=s.quantization_group_size,
                max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                **self._step_policy(role),
                device=s.device, kernel_backend=s.kernel_backend, seed=s.seed,
                enforce_eager=s.enforce_eager or role == "prefill",  # prompts: no graph gains
                cuda_graph_sizes=s.graph_sizes(),
                num_threads=self._threads(role), host=s.worker_host,
                redis_url=redis_url if role == "prefill" else None,
                speculative_config=speculative if role == "decode" else None,
                redis_namespace=s.redis_namespace, max_reservation_s=reservation_s,
                tp_timeout_s=reservation_s + 30.0,
                enable_expert_parallel=s.enable_expert_parallel and role == "decode",
                lora_config=s.lora_config(), **tiers, **tls,
            )

        self._spec = spec  # the planner builds the workers it adds the same way
        prefill = [spec(f"prefill-{i}", "prefill") for i in range(self._num_prefill)]
        decode = [spec(f"decode-{i}", "decode") for i in range(s.decode_workers)]
        # bad engine settings fail here, naming the field, not later inside a remote actor
        # (a draft model too: its config, and a pool holding its KV beside the target's)
        sized(replace(decode[0], num_threads=None).engine_config())
        return WorkerPool(
            prefill=prefill,
            decode=decode,
            decode_tp=s.decode_tp,
            tp_placement=s.decode_tp_placement,
            # on a cluster it joined, the workers outlive this process (a crash): a restarted
            # owner of the deployment adopts them (pdserve.launch.worker)
            deployment=s.redis_namespace if s.ray_address else None,
            gpus=s.device.startswith("cuda"),
            ping_timeout_s=s.worker_silence_s,
            secret=self.secret,
            redis_password=redis_password,
        )

    async def _start_router(self, model_path, model_name, redis_url, infos) -> None:
        from pdserve.launch.router_front import RouterFronts, router_spec
        from pdserve.launch.router_processes import start_router_processes
        from pdserve.router.metrics import RouterMetrics

        s = self.settings
        spec = router_spec(s, model_path, model_name, redis_url, self.tls, self.worker_tls,
                           self.api_tokens)
        self.metrics = RouterMetrics()
        fronts = await RouterFronts.bind(
            spec, self.secret, [(i.worker_id, i.role, i.address) for i in infos], self.metrics)
        self.store, self.router_server = fronts.store, fronts.server
        self.metrics_port = self.metrics.start_http(s.host, s.metrics_port)
        try:
            await fronts.start(ready_timeout_s=60)
        finally:
            self.http = fronts.http
        self.router_processes = await start_router_processes(s, spec, fronts, self.secret,
                                                             self.metrics)
        await self._publish_workers(fronts.router, model_name, redis_url, infos)
        self._start_supervision(fronts.router)

    async def _publish_workers(self, router, model_name: str, redis_url: str, infos) -> None:
        """The worker table in Ray's GCS, kept up to date, for `--router-only` routers."""
        from pdserve.launch.redis_server import split_password
        from pdserve.launch.registry import Registry
        from pdserve.launch.registry_publisher import RegistryPublisher

        s = self.settings
        header = Registry(model_name, s.block_size, s.mode, split_password(redis_url, None)[0],
                          s.redis_namespace, owner="", revision=0, workers=())
        self.registry = RegistryPublisher(header, [(i.worker_id, i.role, i.address)
                                                   for i in infos])
        router.followers.append(self.registry)
        await self.registry.start()

    def _start_supervision(self, router) -> None:
        """The pool's supervisor, telling the router of restarts; the live planner if set."""

        async def on_up(info) -> None:
            await router.add_worker(info.worker_id, info.role, info.address)

        self._supervisor = asyncio.create_task(
            self.pool.supervise(on_up, router.mark_down), name="worker-supervisor")
        if self._policy is not None:
            from pdserve.planner.live import LivePlanner
            from pdserve.planner.perf_model import PerfModel

            s = self.settings
            planner = LivePlanner(self._policy, PerfModel.load(s.planner_perf), router,
                                  self.pool, self._spec, s.decode_tp)
            self._planner = asyncio.create_task(planner.run(), name="planner")


def _cluster_secret() -> ClusterSecret:
    """The operator's secret when the environment names one, else a new one for this cluster."""
    if os.environ.get(cluster_secret.ENV) or os.environ.get(cluster_secret.ENV_FILE):
        return ClusterSecret.from_env()
    return ClusterSecret.generate()


async def drain_routers(server, processes, timeout_s: float) -> int:
    """Every router process of a service (`server`, a RouterServer, and the others) turns
    new requests away and reports not ready at once, then waits for its requests in flight,
    at most `timeout_s` (`RouterServer.drain`); how many of this process's were left."""
    waits = [server.drain(timeout_s)]
    if processes is not None:
        waits.append(processes.drain(timeout_s))
    return (await asyncio.gather(*waits))[0]


async def stop_part(name: str, stop) -> None:
    try:
        await asyncio.wait_for(stop(), STOP_PART_S)
    except TimeoutError:
        logger.error("stopping the %s took over %g s: left behind", name, STOP_PART_S)
    except Exception:
        logger.exception("stopping the %s failed", name)


def as_coroutine(fn):
    """A blocking stop step (each bounded on its own) as a coroutine function."""
    async def run() -> None:
        fn()
    return run


def _stop_ray() -> None:
    from pdserve.launch.ray_runtime import stop_ray

    stop_ray()
