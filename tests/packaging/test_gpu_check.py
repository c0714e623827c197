"""scripts/gpu_check.sh on this CPU: the wheel built by --prepare installs into a Python that is
not the project's venv and imports from there, and every step starts, the CUDA ones saying so.

The "image" is a fresh interpreter seeing the venv's third-party packages (as a GPU image
has torch and, after the install step, the carried wheels) but not pdserve: the venv's
editable install is not active in it, so pdserve can come only from the installed wheel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("install", "kernels", "model", "data-plane", "benchmark")


def _image_python(tmp: Path) -> Path:
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(tmp / "image")],
                   check=True)
    python = tmp / "image" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True)
    (Path(site.stdout.strip()) / "image.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_dry_run_installs_the_wheel_into_another_python_and_starts_every_step(tmp_path):
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    subprocess.run(["bash", "scripts/gpu_check.sh", "--prepare", "--no-download",
                    "--wheels", str(wheels)], cwd=ROOT, check=True, capture_output=True)
    assert [w.name for w in wheels.iterdir()] == ["pdserve-0.1.0-py3-none-any.whl"]
    python = _image_python(tmp_path)
    probe = subprocess.run([str(python), "-c", "import pdserve"], cwd=tmp_path,
                           capture_output=True)
    assert probe.returncode != 0  # the image has no pdserve of its own
    env = {**os.environ, "PDSERVE_GPU_PYTHON": str(python)}
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--wheels", str(wheels),
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in (out / "summary.md").read_text().splitlines()[2:]}
    assert rows == {"install": "ok", **{step: "no CUDA" for step in STEPS[1:]}}
    # "ok" means pdserve imported from the install's target directory (the step checks it)
    assert "Successfully installed pdserve-0.1.0" in (out / "install.log").read_text()
    assert len(list(out.iterdir())) <= 8
    assert done.stdout.endswith((out / "summary.md").read_text())
