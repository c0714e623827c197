"""Default addresses and ports, defined once: the settings, the clients, the bench and the
deploy checks all start from these (each stays overridable where it is used).

Everything binds loopback unless told otherwise: an embedded deployment is reachable from
this machine only, and exposing it is a decision (`--host`, `--worker-host`).
"""

from __future__ import annotations

HOST = "127.0.0.1"
LOOPBACK_HOSTS = (HOST, "localhost", "::1")  # addresses no other machine can reach
ROUTER_PORT = 50051  # gRPC: pdserve.v1.Inference, health, reflection
METRICS_PORT = 9400  # Prometheus text over HTTP
HTTP_PORT = 8000  # the OpenAI-compatible API (vLLM's default port too)
HTTP_TIMEOUT_S = 600.0  # the longest an HTTP request may run; a client's `timeout` is capped
GRPC_TIMEOUT_S = 600.0  # the same for a gRPC Generate, whatever deadline the client gave
# The bundled redis-server takes a free port: never a system Redis's 6379 by accident.
REDIS_PORT = 0

ROUTER_ADDRESS = f"{HOST}:{ROUTER_PORT}"
METRICS_URL = f"http://{HOST}:{METRICS_PORT}/metrics"
# A worker reads the Redis password from its environment (set by the pool, like the cluster
# secret): never from its actor arguments or a URL handed to it.
REDIS_PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"
# Where a decode group's ranks go: Ray's placement strategies, STRICT_PACK (one node) first.
# The Ray namespace of the drivers that join a cluster: a deployment's detached workers and
# placement groups are found there by name when its owner restarts (`Worker.adopt`).
RAY_NAMESPACE = "pdserve"
TP_PLACEMENTS = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
