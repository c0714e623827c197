"""RouterOnly: `pdserve up --router-only`, one more router of a running deployment.

It joins the Ray cluster at `ray_address` as a driver (asking for no resources), reads the
worker registry the deployment's owner publishes there (pdserve.launch.registry: the key
comes from `redis_namespace`), opens its own Redis store (`redis_url`, else the registry's;
the password from `redis_password` / PDSERVE_REDIS_PASSWORD) and serves with a Router of its
own (its own router_id: each decode worker streams it only its own requests, and frees them
when it disappears), following the registry (pdserve.launch.registry_follower). It starts no
worker, Redis, planner or supervisor, binds nothing but its own gRPC, HTTP and metrics ports,
and needs the deployment's cluster secret (PDSERVE_CLUSTER_SECRET[_FILE]). `stop()` stops
what `start()` started; Ray itself only loses a driver.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pdserve.cluster_secret import ClusterSecret
from pdserve.launch import registry
from pdserve.launch.registry import Registry
from pdserve.launch.settings import ServeSettings

logger = logging.getLogger(__name__)

READY_S = 30.0  # serve after this long even if a registered worker is not reachable yet
REDIS_CHECK_S = 5.0


class RouterOnly:
    def __init__(self, settings: ServeSettings) -> None:
        if not settings.ray_address:
            raise ValueError("router_only needs ray_address: the Ray cluster of the running "
                             "deployment to join (e.g. --ray-address auto on one of its nodes)")
        self.settings = settings
        self.secret = ClusterSecret.from_env()  # the deployment's: a fresh one opens nothing
        self.tls = settings.tls()
        self.worker_tls = settings.cluster_tls()
        self.api_tokens = settings.api_tokens()
        self.fronts = None
        self.metrics = None
        self.metrics_port: int | None = None
        self.router_processes = None
        self.follower = None
        self.lost = asyncio.Event()  # the deployment changed under this router: start again
        self._model_name = ""
        self._redis_from_registry = settings.redis_url is None
        self._joined_ray = False

    @property
    def address(self) -> str:
        return self.fronts.server.address

    @property
    def http_url(self) -> str | None:
        return None if self.fronts is None or self.fronts.http is None else self.fronts.http.url

    @property
    def router(self):
        return self.fronts.router

    async def start(self) -> None:
        from pdserve.engine.default_model import resolve_model

        s = self.settings
        model_path = str(await asyncio.to_thread(resolve_model, s.model))
        self._model_name = s.model if not Path(s.model).is_dir() else Path(s.model).name
        self._join_ray()  # on this thread: Ray's driver wants the main thread
        found = await asyncio.to_thread(self._read_registry)
        problem = self._incompatible(found)
        if problem is not None:
            raise ValueError(f"can't join the deployment: {problem}")
        redis_url = s.redis_url or found.redis_url
        if redis_url is None:
            raise ValueError("the deployment publishes no Redis URL: give --redis-url")
        await asyncio.to_thread(check_redis, redis_url, s.redis_password)
        await self._start_router(model_path, redis_url, found)

    async def _start_router(self, model_path: str, redis_url: str, found: Registry) -> None:
        from pdserve.launch.registry_follower import RegistryFollower
        from pdserve.launch.router_front import RouterFronts, router_spec
        from pdserve.launch.router_processes import start_router_processes
        from pdserve.router.metrics import RouterMetrics

        s = self.settings
        spec = router_spec(s, model_path, self._model_name, redis_url, self.tls,
                           self.worker_tls, self.api_tokens)
        self.metrics = RouterMetrics()
        self.fronts = await RouterFronts.bind(spec, self.secret, (), self.metrics)
        self.follower = RegistryFollower(self.fronts.router, s.redis_namespace,
                                         self._incompatible, self._on_lost)
        await self.follower.apply(found)
        self.metrics_port = self.metrics.start_http(s.host, s.metrics_port)
        await self.fronts.start(ready_timeout_s=READY_S, require_ready=False)
        self.router_processes = await start_router_processes(s, spec, self.fronts, self.secret,
                                                             self.metrics)
        self.follower.start()
        logger.info("router %s joined the deployment of %s: %d workers",
                    self.fronts.router.router_id, found.model_name, len(found.workers))

    def _join_ray(self) -> None:
        import ray

        from pdserve.launch.ray_runtime import start_ray

        if not ray.is_initialized():
            start_ray(self.settings.ray_address, resources={}, num_cpus=None, tmpdir=None)
            self._joined_ray = True

    def _read_registry(self) -> Registry:
        ns = self.settings.redis_namespace
        data = registry.get(ns)
        if data is None:
            raise ValueError(
                f"no pdserve deployment publishes its workers in the Ray cluster at "
                f"{self.settings.ray_address} under redis_namespace {ns!r}: start `pdserve up "
                f"--ray-address ...` (without --router-only) first, with the same "
                f"redis_namespace")
        return registry.decode(data)

    def _incompatible(self, found: Registry) -> str | None:
        s = self.settings
        problem = registry.incompatibility(found, self._model_name, s.block_size, s.mode)
        if problem is None and self._redis_from_registry and self.fronts is not None \
                and found.redis_url != self.fronts.spec.redis_url:
            problem = (f"the deployment's Redis moved to {found.redis_url} (its owner "
                       "restarted with a Redis of its own)")
        return problem

    def _on_lost(self, problem: str) -> None:
        self.lost.set()

    async def drain(self, timeout_s: float) -> int:
        """Before `stop` (SIGTERM): see `service.drain_routers`."""
        from pdserve.launch.service import drain_routers

        return await drain_routers(self.fronts.server, self.router_processes, timeout_s)

    async def stop(self) -> None:
        """Stop what `start` started, front to back; each part bounded (see Service)."""
        from pdserve.launch.service import as_coroutine, stop_part

        parts = [
            ("registry follower", self.follower and self.follower.stop),
            ("other router processes", self.router_processes and self.router_processes.stop),
            ("router", self.fronts and self.fronts.stop),
            ("metrics server", self.metrics and as_coroutine(self.metrics.stop_http)),
            ("Ray connection", self._joined_ray and as_coroutine(_leave_ray)),
        ]
        for name, stop in parts:
            if stop:
                await stop_part(name, stop)


def check_redis(url: str, password: str | None, timeout_s: float = REDIS_CHECK_S) -> None:
    """PING the deployment's Redis once; ValueError saying why it refused."""
    import redis

    from pdserve.launch.redis_server import split_password

    where = split_password(url, None)[0]  # never a password in an error message
    client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                  socket_connect_timeout=timeout_s,
                                  **({} if password is None else {"password": password}))
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise ValueError(f"Redis at {where} refused this router ({exc}): give the deployment's "
                         "Redis password in PDSERVE_REDIS_PASSWORD") from None
    except redis.RedisError as exc:
        raise ValueError(f"Redis at {where} is not reachable from this router: {exc}") from None
    finally:
        client.close()


def _leave_ray() -> None:
    """Disconnect this driver; the cluster and its workers go on (they are the owner's)."""
    import ray

    ray.shutdown()
