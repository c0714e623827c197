"""The GPU check: every CUDA path of pdserve, in one bounded run on a lent GPU (docs/gpu.md).

    .venv/bin/python scripts/gpu_check.py --prepare   # here: wheels into .gpu_check/wheels
    python3 scripts/gpu_check.py                      # on the GPU, in the image's Python
    python3 scripts/gpu_check.py --dry-run            # a CPU: CUDA steps say "no CUDA"

(`scripts/gpu_check.sh` runs these.) The GPU machine has no package registry and its own
torch/Triton/protobuf; the check never touches them. It installs pdserve's own wheel and the
pure-Python or cp312 wheels the image lacks (built and downloaded here by --prepare, carried
with the working tree) with --no-deps into a target directory put first on PYTHONPATH, and runs
every step against that install (never the source tree: `python -P`, pytest's append mode).

Steps, each bounded and logged to $OUT/<step>.log:
    install     the wheels; what the image's versions make of them (imports, versions, GPU)
    kernels     tests/kernels in GPU mode: every Triton kernel on CUDA against its reference
    model       tests/on_device: tiny Llama and MoE greedy on CUDA (Triton, CUDA graphs) vs
                the CPU reference: fp32, bf16, int8 KV, int8/int4 weights
    data-plane  CUDA caches through the real KV sender/receiver and Triton packing (loopback);
                an NCCL pair on one GPU refused fast
    benchmark   benchmarks/kernels.py: % of the copy bandwidth and of a cuBLAS GEMM's FLOP/s
Then one summary table, printed and written to $OUT/summary.md (6 files in all). Standard
library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".gpu_check" / "wheels"
# What the checks import beyond torch: the engine's dependencies and pytest. --prepare carries
# these and their requirements (pinned to the venv's versions), less torch's own, which a CUDA
# image has; the install step then installs those the image lacks.
ROOTS = ("transformers", "xgrammar", "jsonschema", "grpcio", "protobuf", "safetensors", "pytest")
IMAGE_HAS = ("torch", "triton", "numpy")
ALWAYS = ("pdserve", "protobuf", "grpcio")  # the stubs need these, whatever the image has
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
PROBE = """
import json, os, sys
import torch, triton, google.protobuf
import pdserve, pdserve.proto, pdserve.kernels.backend, pdserve.llm, pdserve.kvtransfer
cuda = torch.cuda.is_available()
print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__,
    "cuda": torch.version.cuda, "triton": triton.__version__,
    "protobuf": google.protobuf.__version__, "pdserve": os.path.dirname(pdserve.__file__),
    "gpu": torch.cuda.get_device_name() if cuda else None}))
"""
KERNEL_SHARDS = 4  # pytest processes compiling Triton kernels side by side
# pytest against the installed wheel: the tree's folders only appended to sys.path
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "--import-mode=append", "-q", "-rfE"]


@dataclass
class Result:
    step: str
    status: str  # ok | FAILED | no CUDA | timeout | skipped
    seconds: float
    detail: str = ""


class Check:
    def __init__(self, out: Path, wheels: Path, target: Path, dry_run: bool) -> None:
        self.out, self.wheels, self.target, self.dry_run = out, wheels, target, dry_run
        self.gpu: str | None = None
        self.env = {**os.environ, "PYTHONPATH": str(target), "PDSERVE_KERNEL_DEVICE": "cuda",
                    "PYTHONDONTWRITEBYTECODE": "1"}
        self.env.pop("TRITON_INTERPRET", None)

    def run(self, name: str, argv: list[str], timeout: float) -> tuple[int | None, str]:
        """argv under the image's Python, -P: the source tree is not on the path."""
        with open(self.out / f"{name}.log", "a") as log:
            log.write(f"$ {' '.join(argv)}\n")
            log.flush()
            try:
                done = subprocess.run([sys.executable, "-P", *argv], cwd=ROOT, env=self.env,
                                      stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            except subprocess.TimeoutExpired:
                return None, ""
        return done.returncode, (self.out / f"{name}.log").read_text()

    def install(self) -> Result:
        start, log = time.monotonic(), self.out / "install.log"
        wheels = sorted(self.wheels.glob("*.whl"))
        if not any(w.name.startswith("pdserve-") for w in wheels):
            log.write_text(f"no pdserve wheel in {self.wheels}: run --prepare here first\n")
            return Result("install", "FAILED", 0.0, "no wheel (run --prepare)")
        chosen, kept = [], []
        for wheel in wheels:
            dist = wheel.name.split("-")[0].replace("_", "-").lower()
            (chosen if dist in ALWAYS or not _installed(dist) else kept).append(wheel)
        with open(log, "w") as f:
            f.write(f"image already has: {', '.join(w.name for w in kept) or 'none'}\n")
        argv = ["-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
                "--disable-pip-version-check", "--target", str(self.target),
                *map(str, chosen)]
        code, _ = self.run("install", argv, 60)
        if code != 0:
            return Result("install", "FAILED", time.monotonic() - start, "pip install failed")
        code, text = self.run("install", ["-c", PROBE], 40)
        seconds = time.monotonic() - start
        probe = _last_json(text) if code == 0 else None
        if probe is None:
            return Result("install", "FAILED", seconds, "the install does not import (log)")
        if not Path(probe["pdserve"]).resolve().is_relative_to(self.target.resolve()):
            return Result("install", "FAILED", seconds, f"pdserve came from {probe['pdserve']}")
        self.gpu = probe["gpu"]
        return Result("install", "ok", seconds,
                      f"{len(chosen)} wheels; python {probe['python']}, torch {probe['torch']} "
                      f"(CUDA {probe['cuda']}), triton {probe['triton']}, protobuf "
                      f"{probe['protobuf']}; {self.gpu or 'no GPU'}")

    def pytest(self, name: str, paths: list[str], timeout: float) -> Result:
        if self.gpu is None:
            return self._no_cuda(name)
        start = time.monotonic()
        code, text = self.run(name, [*PYTEST, *paths], timeout)
        return _pytest_result(name, code, text, time.monotonic() - start)

    def kernels(self, timeout: float) -> Result:
        """tests/kernels in shards run side by side (the Triton compiles are the cost)."""
        if self.gpu is None:
            return self._no_cuda("kernels")
        files = sorted(ROOT.glob("tests/kernels/test_*.py"), key=lambda p: -p.stat().st_size)
        shards = [[str(p.relative_to(ROOT)) for p in files[i::KERNEL_SHARDS]]
                  for i in range(min(KERNEL_SHARDS, len(files)))]  # none empty: that runs all
        start, procs = time.monotonic(), []
        parts = [self.out / f"kernels.{i}.part" for i in range(len(shards))]
        for shard, part in zip(shards, parts):
            with open(part, "w") as log:  # the child keeps its own copy of the descriptor
                procs.append(subprocess.Popen([sys.executable, "-P", *PYTEST, *shard], cwd=ROOT,
                                              env=self.env, stdout=log, stderr=subprocess.STDOUT))
        codes = [_wait(p, start + timeout) for p in procs]
        text = "".join(part.read_text() for part in parts)
        (self.out / "kernels.log").write_text(text)
        for part in parts:
            part.unlink()
        seconds = time.monotonic() - start
        if None in codes:
            return Result("kernels", "timeout", seconds, _counts(text))
        return _pytest_result("kernels", max(codes), text, seconds)

    def benchmark(self, timeout: float) -> Result:
        if self.gpu is None:
            return self._no_cuda("benchmark")
        start = time.monotonic()
        code, text = self.run("benchmark", ["benchmarks/kernels.py", "--repeat", "5"], timeout)
        seconds = time.monotonic() - start
        if code is None:
            return Result("benchmark", "timeout", seconds)
        decode = re.search(r"^decode attn, kv float16 .*?(\d+)%", text, re.M)
        detail = f"paged decode at {decode.group(1)}% of copy" if decode else "see log"
        return Result("benchmark", "ok" if code == 0 else "FAILED", seconds, detail)

    def _no_cuda(self, name: str) -> Result:
        (self.out / f"{name}.log").write_text("no CUDA: step not run\n")
        return Result(name, "no CUDA", 0.0, "dry run" if self.dry_run else "no GPU here")


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None


def _wait(proc: subprocess.Popen, deadline: float) -> int | None:
    try:
        return proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def _counts(text: str) -> str:
    """pytest's final counts ("3 failed, 40 passed in 5.1s"), summed over the logs in `text`."""
    totals: dict[str, int] = {}
    for line in text.splitlines():
        if re.match(r"^=*\s*\d+ \w+.* in [\d.]+s", line):
            for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)", line):
                totals[what] = totals.get(what, 0) + int(n)
    return ", ".join(f"{n} {what}" for what, n in totals.items()) or "no pytest summary"


def _pytest_result(name: str, code: int | None, text: str, seconds: float) -> Result:
    if code is None:
        return Result(name, "timeout", seconds, _counts(text))
    return Result(name, "ok" if code == 0 else "FAILED", seconds, _counts(text))


def summary(results: list[Result]) -> str:
    rows = [f"| {r.step} | {r.status} | {r.seconds:.0f} | {r.detail} |" for r in results]
    return "\n".join(["| step | status | s | detail |", "|---|---|---|---|", *rows]) + "\n"


def check(out: Path, wheels: Path, target: Path, dry_run: bool) -> list[Result]:
    c = Check(out, wheels, target, dry_run)
    results = [c.install()]
    if results[0].status != "ok":
        return results + [Result(s, "skipped", 0.0, "install failed")
                          for s in ("kernels", "model", "data-plane", "benchmark")]
    results.append(c.kernels(150))  # the bounds add up to 480 s: 8 minutes
    results.append(c.pytest("model", ["tests/on_device/test_greedy.py"], 130))
    results.append(c.pytest("data-plane", [
        "tests/kvtransfer/test_loopback.py::test_round_trip_with_resharding",
        "tests/on_device/test_kv_pair.py"], 40))
    results.append(c.benchmark(60))
    return results


def _closure(roots: tuple[str, ...], known: set[str], python: str) -> set[str]:
    """`roots` and what they require on Linux x86-64 CPython `python`, less `known` (venv
    metadata; extras are not followed)."""
    from packaging.markers import Marker
    from packaging.requirements import Requirement

    env = {"python_version": python, "python_full_version": f"{python}.0", "extra": "",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "os_name": "posix", "implementation_name": "cpython",
           "platform_python_implementation": "CPython"}
    found, todo = set(), [r.lower() for r in roots]
    while todo:
        name = todo.pop()
        if name in found or name in known:
            continue
        found.add(name)
        for text in importlib.metadata.requires(name) or ():
            req = Requirement(text)
            if req.marker is None or Marker(str(req.marker)).evaluate(env):
                todo.append(req.name.lower().replace("_", "-"))
    return found


def prepare(wheels: Path, download: bool, python: str) -> None:
    """Here, in the venv: pdserve's wheel, and the dependency wheels for CPython `python`."""
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(ROOT)], check=True)
    if download:
        image = _closure(IMAGE_HAS, set(), python)
        pins = [f"{d}=={importlib.metadata.version(d)}" for d in _closure(ROOTS, image, python)]
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        subprocess.run([*pip, "download", "-q", "--only-binary=:all:", "--no-deps",
                        "--python-version", python, "--implementation", "cp",
                        "--abi", "cp" + python.replace(".", ""),
                        *platforms, "-d", str(wheels), *pins], check=True)
    size = sum(w.stat().st_size for w in wheels.glob("*.whl"))
    print(f"{len(list(wheels.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {wheels}; on the "
          "GPU: the device tool, command `bash scripts/gpu_check.sh`, carry [\".gpu_check\"]")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prepare", action="store_true", help="build and download the wheels")
    parser.add_argument("--no-download", action="store_true", help="--prepare: pdserve's only")
    parser.add_argument("--python-version", default="3.12",
                        help="--prepare: the GPU image's Python (default 3.12)")
    parser.add_argument("--dry-run", action="store_true", help="a CPU run: CUDA steps say so")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-check-out"))
    parser.add_argument("--wheels", type=Path, default=WHEELS, help=f"default {WHEELS}")
    args = parser.parse_args()
    if args.prepare:
        prepare(args.wheels, not args.no_download, args.python_version)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-"))
    try:
        results = check(out, args.wheels, target, args.dry_run)
    finally:
        shutil.rmtree(target, ignore_errors=True)
    table = summary(results)
    (out / "summary.md").write_text(table)
    print(table, end="")
    failed = [r for r in results if r.status not in ("ok", "no CUDA")]
    no_cuda = any(r.status == "no CUDA" for r in results)
    return 1 if failed or (no_cuda and not args.dry_run) else 0


if __name__ == "__main__":
    sys.exit(main())
