"""Kernel tests: the Triton kernels against their references, on the device of the mode.

CPU mode (the default): Triton's interpreter runs the kernels on CPU tensors. The root
conftest sets TRITON_INTERPRET=1 before any test module imports `kernels` (tests.kernel_device).

GPU mode (`PDSERVE_KERNEL_DEVICE=cuda`, run by `scripts/gpu_check.sh`): the interpreter is
off, and every Triton entry point a test module imported (and `get_backend(..., "triton")`) is
swapped for one that runs on CUDA while the test keeps its CPU cases, references and tolerances
(tests/kernels/on_device.py). Modules that test only the CPU room are skipped there.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import pytest
import torch
from on_device import Shuttled, shuttled

from pdserve.kernels import backend
from pdserve.kernels.triton import launch
from tests.kernel_device import kernel_device

DEVICE = torch.device(kernel_device(os.environ))
GPU_MODE = DEVICE.type == "cuda"
TRITON_ROOM = "pdserve.kernels.triton."


def _is_triton_entry(value: Any) -> bool:
    """A kernel wrapper (or kernel class) of the Triton room; its launch helpers are not."""
    module = getattr(value, "__module__", None) or ""
    return callable(value) and module.startswith(TRITON_ROOM) and module != launch.__name__


def _uses_triton(module: ModuleType) -> bool:
    return any(_is_triton_entry(v) for v in vars(module).values())


def _get_backend_on_device(device: Any = None, name: str | None = None) -> Any:
    """`get_backend`, but the Triton backend is the CUDA one, shuttled."""
    if name != "triton":
        return backend.get_backend(device, name)
    return Shuttled(backend.get_backend(DEVICE, name), DEVICE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not GPU_MODE:
        return
    skip = pytest.mark.skip(reason="GPU mode runs the Triton kernels' tests; this one is CPU-only")
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and not _uses_triton(module):
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _kernels_on_device(request: pytest.FixtureRequest):
    if not GPU_MODE:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        for name, value in list(vars(request.module).items()):
            if _is_triton_entry(value):
                patch.setattr(request.module, name, shuttled(value, DEVICE))
            elif value is backend.get_backend:
                patch.setattr(request.module, name, _get_backend_on_device)
        yield


@pytest.fixture(autouse=True)
def _kernels_mode():
    if GPU_MODE and (launch.interpreting() or not torch.cuda.is_available()):
        pytest.fail("GPU mode (PDSERVE_KERNEL_DEVICE=cuda) needs CUDA and TRITON_INTERPRET unset "
                    "before anything imports kernels")
    if not GPU_MODE and not launch.interpreting():
        pytest.fail(
            "kernels was imported before TRITON_INTERPRET=1 was set, so its Triton kernels "
            "were defined for a GPU; tests/conftest.py sets it (tests.kernel_device) before "
            "anything imports kernels"
        )


@pytest.fixture(autouse=True)
def _one_thread():
    """The interpreter is single-threaded numpy; keep torch off the other core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seeded():
    """Inputs drawn from torch's global generator are the same whatever ran before: a failure
    reproduces alone."""
    torch.manual_seed(0)
