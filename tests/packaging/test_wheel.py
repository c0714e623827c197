"""The built wheel installs one top-level package, `pdserve`, and works beside the packages
whose names its folders would otherwise take: proto-plus's `proto` and Hugging Face's `kernels`.

Built from a copy of the working tree and installed into a fresh virtualenv, exercised from a
directory outside the repository (so nothing resolves to the source folders). The pinned
dependencies are this environment's (which `scripts/setup.sh` installed from the same pins):
the new virtualenv sees them behind its own site-packages (a path in a .pth file), so the test
does not copy torch again; proto-plus and `kernels` are installed into it themselves.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from tests.packaging.imports import ROOT

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
ENGINE = {"num_kv_blocks": 32, "max_model_len": 256, "max_num_seqs": 4}
NOT_SOURCE = (".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", "bench-results",
              ".pytest_cache", ".ruff_cache")

CHECK = """
import json, sys
import kernels, proto
assert hasattr(proto, "Message") and hasattr(proto, "Field"), proto.__file__   # proto-plus
assert hasattr(kernels, "get_kernel"), kernels.__file__                        # HF kernels
import pdserve
from pdserve import LLM, Client, SamplingParams
from pdserve.proto import worker_pb2_grpc
assert pdserve.__file__.startswith(sys.prefix), pdserve.__file__
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
out = llm.generate([sys.argv[3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print(json.dumps({"token_ids": out[0].token_ids, "proto": proto.__file__,
                  "kernels": kernels.__file__, "pdserve": pdserve.__file__}))
"""


def run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, f"{args}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("src") / "pdserve"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    out = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", out, source,
        cwd=source)
    (built,) = out.glob("pdserve-*.whl")
    return built


def test_wheel_holds_only_the_pdserve_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert top_level == {"pdserve"}
    for stub in ("pdserve_pb2", "pdserve_pb2_grpc", "worker_pb2", "worker_pb2_grpc", "raw_pb2"):
        assert f"pdserve/proto/{stub}.py" in names


def test_installed_beside_proto_plus_and_hf_kernels(wheel, tiny_llama_dir, tmp_path) -> None:
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    python, pip = venv / "bin" / "python", [venv / "bin" / "python", "-m", "pip"]
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
               cwd=tmp_path, env=env).strip()
    # a plain path line: the directory joins sys.path, its own .pth files (this checkout's
    # editable install among them) are not run
    (Path(site) / "pinned_dependencies.pth").write_text(sysconfig.get_paths()["purelib"])
    quiet = ("--quiet", "--disable-pip-version-check")
    run(*pip, "install", *quiet, "--no-deps", wheel, cwd=tmp_path, env=env)
    run(*pip, "install", *quiet, "--ignore-installed", "--no-deps", "proto-plus", "kernels",
        cwd=tmp_path, env=env)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run(python, "-c", CHECK, tiny_llama_dir, json.dumps(ENGINE), PROMPT, cwd=elsewhere,
              env=env)
    found = json.loads(out.strip().splitlines()[-1])
    for name in ("proto", "kernels", "pdserve"):
        assert found[name].startswith(str(venv)), found
    expected = LLM(str(tiny_llama_dir), **ENGINE).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert found["token_ids"] == expected.token_ids
    assert "pdserve up" in run(venv / "bin" / "pdserve", "--help", cwd=elsewhere, env=env)
