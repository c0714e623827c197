"""The backend registry: selection by device, and one signature per op across backends."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from pdserve.kernels.checks import new_output
from pdserve.kernels.registry import CPU_BACKEND, TORCH_BACKEND, TRITON_BACKEND, get_backend


def test_cpu_defaults_to_the_native_kernels_and_names_are_checked():
    assert get_backend(torch.device("cpu")).name == "cpu"  # the C kernels build here
    assert get_backend(torch.device("cpu"), "torch") is TORCH_BACKEND
    with pytest.raises(ValueError, match="must be one of"):
        get_backend(torch.device("cpu"), "cuda-graphs")


def test_triton_on_cpu_only_under_the_interpreter():
    assert get_backend(torch.device("cpu"), "triton") is TRITON_BACKEND


@pytest.mark.parametrize("backend", [TRITON_BACKEND, CPU_BACKEND], ids=["triton", "cpu"])
@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(TORCH_BACKEND)][1:])
def test_backends_share_signatures(field, backend):
    """Other backends take the reference's parameters, plus keyword-only tuning knobs."""
    ref = inspect.signature(getattr(TORCH_BACKEND, field)).parameters
    ours = inspect.signature(getattr(backend, field)).parameters
    positional = [p for p in ours.values() if p.kind != inspect.Parameter.KEYWORD_ONLY]
    assert positional == [p for p in ref.values() if p.kind != inspect.Parameter.KEYWORD_ONLY]
    for p in ref.values():  # the reference's keyword-only options exist on both
        if p.kind == inspect.Parameter.KEYWORD_ONLY:
            assert ours[p.name] == p


def test_outputs_are_poisoned_under_the_interpreter():
    """What makes an element a kernel forgot to write fail its test."""
    assert torch.isnan(new_output((3, 4), torch.float16, torch.device("cpu"))).all()
    assert (new_output((5,), torch.int8, torch.device("cpu")) == -128).all()
