"""The worker plane's gRPC settings, shared by the workers' servers and the router's channels.

Every worker server is authenticated (`ClusterAuthInterceptor`: a call without the cluster
secret's token is UNAUTHENTICATED before any handler runs), carries messages up to 64 MiB
both ways (a prompt near the public 4 MiB limit grows on its way to a worker), and keeps
idle connections alive with HTTP/2 pings, so a half-open TCP connection is found within
`keepalive_time + keepalive_timeout` rather than never.

Optional mutual TLS on top of the secret (`worker_tls`): then every worker port is a TLS port
that requires a client certificate from the cluster's CA, and the router presents one. One
certificate serves the whole worker plane (the same files mounted on every node): it must
carry the DNS name `pdserve-worker` (WORKER_TLS_NAME) and both the serverAuth and clientAuth
extended key usages. Workers bind changing IPs, so the router dials them by IP and checks the
name instead (`grpc.ssl_target_name_override`). The KV data plane (TCPStore, gloo/NCCL) has
no TLS: it stays authenticated by the secret's signed handshakes, in the clear.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent import futures

import grpc

from pdserve.address import host_port
from pdserve.cluster_secret import ClusterAuthInterceptor, ClusterSecret
from pdserve.tls import TLSFiles

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

MESSAGE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
)
SERVER_OPTIONS = MESSAGE_OPTIONS + KEEPALIVE_OPTIONS
WORKER_TLS_NAME = "pdserve-worker"  # the DNS name the worker plane's certificate must carry
# a client of a TLS worker verifies this name, whatever IP it dialed
TLS_CHANNEL_OPTIONS: tuple[tuple[str, str], ...] = (
    ("grpc.ssl_target_name_override", WORKER_TLS_NAME),
)


def worker_server(secret: ClusterSecret, max_workers: int, thread_prefix: str) -> grpc.Server:
    """A worker's gRPC server: cluster-authenticated, 64 MiB messages, keepalive pings."""
    if not isinstance(secret, ClusterSecret):
        raise ValueError(f"a worker server needs the cluster's ClusterSecret, got "
                         f"{type(secret).__name__} (ClusterSecret.from_env() in a worker)")
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers, thread_name_prefix=thread_prefix),
        interceptors=[ClusterAuthInterceptor(secret)],
        options=list(SERVER_OPTIONS),
    )


def check_worker_tls(paths: Mapping[str, str | None]) -> bool:
    """Whether worker-plane mTLS is on: all of certificate, key and CA given (True) or none
    (False); ValueError naming the missing ones otherwise. `paths`: {setting name: path}."""
    missing = [name for name, path in paths.items() if not path]
    if len(missing) == len(paths):
        return False
    if missing:
        raise ValueError(
            f"worker-plane mutual TLS needs all of {', '.join(paths)}; {', '.join(missing)} "
            f"not set (one certificate with DNS name {WORKER_TLS_NAME!r} for server and client "
            "auth, its key, and the CA that signed it; or none of them for no TLS)")
    return True


def worker_tls(paths: Mapping[str, str | None]) -> TLSFiles | None:
    """The worker plane's TLS files (checked to exist) in the order cert, key, CA; or None."""
    if not check_worker_tls(paths):
        return None
    cert, key, ca = paths.values()
    return TLSFiles(cert, key, ca)


def bind(server: grpc.Server, host: str, tls: TLSFiles | None) -> int:
    """Bind a free port on `host`: mutual TLS when `tls` is given, else plaintext; the port."""
    if tls is None:
        return server.add_insecure_port(host_port(host, 0))
    if tls.ca is None:
        raise ValueError("worker-plane TLS is mutual: it needs the CA that signs the router's "
                         "client certificate")
    return server.add_secure_port(host_port(host, 0), tls.server_credentials())
