"""Fixtures of the Helm chart tests: the pinned helm binary and Kubernetes' schemas."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .helm_chart import install_helm

KUBERNETES_VALIDATE = "kubernetes-validate==1.30.0"


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = install_helm()
    # helm's own state (repos, cache) in a throwaway place, not the user's.
    home = tmp_path_factory.mktemp("helm-home")
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        os.environ[var] = str(home / var.lower())
    return binary


@pytest.fixture(scope="session")
def kubernetes_validate() -> Any:
    """Kubernetes' own schemas (pip-installed into this venv if missing)."""
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
