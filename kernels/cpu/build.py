"""Build and load the C kernels that sit beside their modules (`kernels/cpu/<name>.c`).

A kernel is compiled once per (source and headers, compiler, CPU flags) with the system C compiler
(`$CC`, else `cc`): `-O3 -march=native -fopenmp`, into `$PDSERVE_CACHE_DIR/kernels` (default
`~/.cache/pdserve/kernels`), written under a temporary name and renamed, so concurrent
workers never load a half-written library. Triton and inductor need the same compiler on the
CPU; where there is none, `load` returns None and callers keep the torch reference.

The library links libgomp by its soname; loaded into a torch process, it shares torch's
already-loaded OpenMP runtime (and so `torch.set_num_threads`), instead of starting a second
thread pool that would fight torch's for the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

FLAGS = (
    "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11",
    # dot products as vector trees, not a serial chain of scalar adds (no finite-math
    # assumption: NaN and inf behave as without the flags)
    "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
    # x86: use all 512 bits where AVX-512 is (gcc defaults to 256 there); other CPUs lack the flag
    *(("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()),
)
DISABLE_ENV = "PDSERVE_NATIVE_KERNELS"  # "0": never build or load (torch reference only)


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve"
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled `kernels/cpu/<name>.c`, or None (no compiler, disabled, or a failed build)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler (set CC): %s runs on the torch reference", name)
        return None
    here = Path(__file__).parent
    # every source it may include: the headers, and the .c files another one includes whole
    # (fused_moe.c includes linear_bf16.c), so an edit to any of them rebuilds it
    sources = [here / f"{name}.c", *sorted(here.glob("*.h")), *sorted(here.glob("*.c"))]
    key = hashlib.sha256(b"\0".join(
        [*(p.read_bytes() for p in sources), " ".join(FLAGS).encode(), _version(cc).encode(),
         _cpu_flags().encode()]
    )).hexdigest()[:16]
    path = cache_dir() / f"{name}-{key}.so"
    try:
        if not path.exists():
            _build(cc, Path(__file__).parent / f"{name}.c", path)
        return ctypes.CDLL(str(path))
    except subprocess.CalledProcessError as e:
        logger.warning("building %s failed: it runs on the torch reference\n%s", name, e.stderr)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("building %s failed (%s): it runs on the torch reference", name, e)
    return None


def _build(cc: str, source: Path, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *FLAGS, str(source), "-o", tmp, "-lm"], check=True, capture_output=True,
            text=True, timeout=120,
        )
        os.replace(tmp, path)
        logger.info("built %s", path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


I64, PTR, INT, FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
DTYPE_CODES = {"float32": 0, "bfloat16": 1}  # the C kernels' `dtype` argument


@functools.cache
def function(name: str, symbol: str, argtypes: tuple, restype=None):
    """`symbol` of the compiled `kernels/cpu/<name>.c` with its C signature, or None (`load`)."""
    lib = load(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn
