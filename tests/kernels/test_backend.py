"""The one dispatch (kernels.backend): selection by device, one signature per op across the
backends, and only the chosen backend's room imported."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

from pdserve.kernels.backend import KernelBackend, get_backend
from pdserve.kernels.triton.launch import new_output

OPS = [name for name, value in vars(KernelBackend).items() if isinstance(value, staticmethod)]


def test_cpu_defaults_to_the_native_kernels_and_names_are_checked():
    assert get_backend(torch.device("cpu")).name == "cpu"  # the C kernels build here
    assert type(get_backend(torch.device("cpu"), "torch")) is KernelBackend
    with pytest.raises(ValueError, match="must be one of"):
        get_backend(torch.device("cpu"), "cuda-graphs")
    with pytest.raises(ValueError, match="needs a CPU device"):
        get_backend(torch.device("meta"), "cpu")


def test_triton_on_cpu_only_under_the_interpreter():
    assert get_backend(torch.device("cpu"), "triton").name == "triton"


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("op", OPS)
def test_backends_share_signatures(op, backend):
    """Other backends take the reference's parameters, plus keyword-only tuning knobs."""
    ref = inspect.signature(getattr(KernelBackend, op)).parameters
    ours = inspect.signature(getattr(get_backend("cpu", backend), op)).parameters
    positional = [p for p in ours.values() if p.kind != inspect.Parameter.KEYWORD_ONLY]
    assert positional == [p for p in ref.values() if p.kind != inspect.Parameter.KEYWORD_ONLY]
    for p in ref.values():  # the reference's keyword-only options exist on both
        if p.kind == inspect.Parameter.KEYWORD_ONLY:
            assert ours[p.name] == p


def test_the_ops_are_every_kernel_the_model_calls():
    """The reference backend names an op for each kernel module of the other rooms."""
    assert {"store_kv", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
            "rotary_embedding", "silu_and_mul", "pack_blocks", "unpack_blocks"} <= set(OPS)


def _imported_after(code: str) -> set[str]:
    """The top-level modules of pdserve.kernels' rooms and of Triton that `code` imports."""
    probe = (f"import sys\n{code}\n"
             "print(' '.join(sorted(m for m in sys.modules if m == 'triton' "
             "or m.startswith(('pdserve.kernels.cpu', 'pdserve.kernels.triton')))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, check=True)
    return set(out.stdout.split())


def test_the_cpu_path_never_imports_triton():
    imported = _imported_after(
        "from pdserve.kernels.backend import get_backend\n"
        "assert get_backend('cpu').name == 'cpu'\n"
        "import pdserve.engine.model_runner, pdserve.kvtransfer.sender")
    assert "triton" not in imported
    assert "pdserve.kernels.cpu.backend" in imported


def test_the_triton_path_never_imports_the_c_kernels_glue():
    imported = _imported_after(
        "from pdserve.kernels.backend import get_backend\n"
        "assert get_backend('cpu', 'triton').name == 'triton'\n"
        "import pdserve.engine.model_runner, pdserve.kvtransfer.sender")
    assert "triton" in imported
    assert not {m for m in imported if m.startswith("pdserve.kernels.cpu")}


def test_outputs_are_poisoned_under_the_interpreter():
    """What makes an element a kernel forgot to write fail its test."""
    assert torch.isnan(new_output((3, 4), torch.float16, torch.device("cpu"))).all()
    assert (new_output((5,), torch.int8, torch.device("cpu")) == -128).all()
