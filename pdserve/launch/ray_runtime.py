"""The Ray runtime of this process: join a cluster, or start a local head bound to loopback.

Nothing here places or watches workers (`pool`, `supervisor`); requests never go through Ray.
The process's own SIGTERM and SIGINT handling survives `ray.init` (see `_signals_kept`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Sequence

import ray

from pdserve import defaults
from pdserve.address import split_host_port

WILDCARD_HOSTS = ("0.0.0.0", "::")  # bind every interface; not an address to dial
GCS_PROBE_TIMEOUT_S = 5.0


def start_ray(address: str | None, resources: dict[str, float], num_cpus: int | None,
              tmpdir: str | None) -> None:
    """Join the Ray cluster at `address`, or (None) start a local head on loopback only.

    `resources` and `num_cpus` describe the local head; a joined cluster has its own.
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if tmpdir is not None:
        os.environ["RAY_TMPDIR"] = tmpdir  # its sessions, sockets and logs; read by children too
    if address is None:
        with _loopback_stays_loopback(), _signals_kept():
            ray.init(address="local", _node_ip_address=defaults.HOST, include_dashboard=False,
                     resources=dict(resources), num_cpus=num_cpus)
        return
    try:
        host = split_host_port(address)[0]
    except ValueError:  # "auto", or another form Ray resolves (and authenticates) itself
        host = None
    else:
        _send_token_if_needed(address)
    loopback = host in defaults.LOOPBACK_HOSTS
    with _loopback_stays_loopback() if loopback else contextlib.nullcontext(), _signals_kept():
        ray.init(address=address, namespace=defaults.RAY_NAMESPACE)


def _send_token_if_needed(address: str) -> None:
    """Join with Ray's auth token when the cluster asks for one and RAY_AUTH_MODE is unset.

    A new local Ray cluster turns token authentication on (and writes ~/.ray/auth_token), and
    so does `ray start --head` wherever that file exists; but `ray.init` with an explicit
    address sends no token unless RAY_AUTH_MODE=token, so joining such a cluster failed after
    20 s ("InvalidAuthToken"). The GCS answers one unauthenticated call at once: UNAUTHENTICATED
    means the cluster wants the token (a cluster without authentication must not get one: its
    workers could not call back into a driver that then demands it). RAY_AUTH_MODE set either
    way is obeyed as it is."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return
    import grpc
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=GCS_PROBE_TIMEOUT_S)
            return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                return  # unreachable or else: ray.init reports it as it does
    if not maybe_enable_token_auth_if_token_available(warn_if_disabled=False):
        raise ValueError(
            f"ray_address: the Ray cluster at {address} requires its auth token: copy the "
            "head's ~/.ray/auth_token here (or point RAY_AUTH_TOKEN_PATH at it)")


def node_addresses() -> list[str]:
    """The address of every live node of the joined cluster."""
    return [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]


def unreachable_worker_host(worker_host: str, addresses: Sequence[str]) -> str | None:
    """Why workers binding `worker_host` could not all be reached from the router, given the
    cluster's node addresses, or None. A loopback host is reachable on its own node only, and
    a wildcard one (0.0.0.0, ::) is dialed as loopback: either is fine while every node is on
    loopback (one machine), and wrong once any node is not."""
    if worker_host not in (*defaults.LOOPBACK_HOSTS, *WILDCARD_HOSTS):
        return None  # 'auto' (each node's address) or an address of the operator's
    remote = sorted({a for a in addresses if a not in defaults.LOOPBACK_HOSTS})
    if not remote:
        return None
    return (f"worker_host {worker_host!r}: the Ray cluster has nodes at {', '.join(remote)}, "
            "whose workers the router could not reach there; use --worker-host auto (each "
            "node's address)")


def stop_ray() -> None:
    """Disconnect; a local head started by `start_ray` stops with it (nothing else does)."""
    ray.shutdown()


@contextlib.contextmanager
def _loopback_stays_loopback():
    # ray.init rewrites a loopback address to the host's public IP (for other nodes to reach);
    # a head bound to 127.0.0.1 is only reachable as 127.0.0.1, so keep it for this call.
    from ray._private import ray_constants

    saved, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@contextlib.contextmanager
def _signals_kept():
    # ray.init puts its own SIGTERM handlers in: a Python one (sys.exit) and, under it, the
    # core worker's C++ one (a stack dump, then abort: exit 134). Either would cut every stream
    # that `pdserve up`'s drain should finish, so the handlers the process had come back after
    # it (signal.signal reinstalls the C-level one too; asyncio's wakeup fd is untouched).
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; ray.init sets none from elsewhere
        return
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if handler is not None:  # None: set from C, outside Python's view
                signal.signal(sig, handler)
