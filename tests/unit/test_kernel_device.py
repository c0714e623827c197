"""The kernel tests' GPU mode, checked on the CPU: the interpreter switch, and the shuttle that
runs a kernel on the device while a test keeps its CPU tensors (its device here is the CPU:
every argument still goes to a storage of its own and comes back)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.kernel_device import kernel_device, set_interpreter

sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
from on_device import Shuttled, shuttled  # noqa: E402

CPU = torch.device("cpu")


def test_gpu_mode_is_asked_for_and_only_it_turns_the_interpreter_off():
    assert kernel_device({}) == "cpu"
    assert kernel_device({"PDSERVE_KERNEL_DEVICE": ""}) == "cpu"
    assert kernel_device({"PDSERVE_KERNEL_DEVICE": "cuda"}) == "cuda"
    with pytest.raises(ValueError, match="PDSERVE_KERNEL_DEVICE='gpu'"):
        kernel_device({"PDSERVE_KERNEL_DEVICE": "gpu"})
    for before in ({}, {"TRITON_INTERPRET": "0"}):  # on a GPU machine too: interpreted
        env = dict(before)
        set_interpreter(env)
        assert env["TRITON_INTERPRET"] == "1"
    env = {"PDSERVE_KERNEL_DEVICE": "cuda", "TRITON_INTERPRET": "1"}
    set_interpreter(env)
    assert "TRITON_INTERPRET" not in env


def test_in_place_writes_land_in_the_callers_tensors_with_strides_and_aliases_kept():
    cache = torch.zeros(4, 6)
    k, v = cache[:2], cache[2:]  # two views of one storage
    strided = torch.arange(12.0).view(3, 4)[:, ::2]
    seen = {}

    def kernel(k, v, x):
        seen.update(moved=k.data_ptr() != cache.data_ptr(), stride=x.stride(),
                    alias=k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr())
        k.fill_(1.0)
        v[0, 0] = 2.0
        return k, x * 2

    out_k, doubled = shuttled(kernel, CPU)(k, v, strided)
    assert seen == {"moved": True, "stride": strided.stride(), "alias": True}
    assert cache[:2].eq(1).all() and cache[2, 0] == 2 and cache[3].eq(0).all()
    assert out_k.data_ptr() == k.data_ptr()  # a view of an argument is that argument again
    torch.testing.assert_close(doubled, strided * 2)


@dataclass(frozen=True)
class Meta:
    slots: torch.Tensor
    n: int


class Kernel:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T

    def scale(self, x: torch.Tensor, meta: Meta) -> torch.Tensor:
        return x[meta.slots] * meta.n


def test_dataclasses_and_returned_objects_are_shuttled_too():
    weight = torch.randn(3, 5)
    kernel = shuttled(Kernel, CPU)(weight)
    assert isinstance(kernel, Shuttled)
    x = torch.randn(2, 5)
    torch.testing.assert_close(kernel(x), x @ weight.T)
    torch.testing.assert_close(kernel.scale(x, Meta(torch.tensor([1, 0]), 3)), x[[1, 0]] * 3)
    shape_only = torch.empty(2, 5, device="meta")  # argument checks pass meta tensors
    assert shuttled(lambda t: t.shape, CPU)(shape_only) == (2, 5)
