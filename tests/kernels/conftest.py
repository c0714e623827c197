"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

Triton decides interpreted-or-compiled when a kernel is *defined*, so the flag is set here,
before any test module imports `kernels`. When this suite shares a pytest process with tests
that import `kernels` first (collection order), the flag must already be set by then: set it
in tests/conftest.py too, on machines without CUDA.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from pdserve.kernels.triton import launch  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreted_kernels():
    if not launch.interpreting():
        pytest.fail(
            "kernels was imported before TRITON_INTERPRET=1 was set, so its Triton kernels "
            "were defined for a GPU; set TRITON_INTERPRET=1 in the environment or in "
            "tests/conftest.py before anything imports kernels"
        )


@pytest.fixture(autouse=True)
def _one_thread():
    """The interpreter is single-threaded numpy; keep torch off the other core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
