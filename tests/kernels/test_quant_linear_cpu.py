"""The CPU's weight-only quantized linears (torch's packed ops) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu import quant_linear
from pdserve.kernels.cpu.quant_linear import Int4Linear, Int8Linear
from pdserve.kernels.quant_weights import quantize
from pdserve.kernels.reference.linear import QuantLinearRef
from pdserve.kernels.reference.quant_linear import quant_linear_ref

CASES = [(4, 32, Int4Linear), (4, 64, Int4Linear), (4, 128, Int4Linear), (8, 0, Int8Linear),
         (8, 32, QuantLinearRef)]


def case(bits, group_size, rows, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(96, 256, generator=g) * 0.05, bits, group_size)
    x = torch.randn(rows, 256, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    return w, x, bias


@pytest.mark.parametrize("bits,group_size,kind", CASES)
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_fp32_matches_the_reference(bits, group_size, kind, rows):
    w, x, bias = case(bits, group_size, rows, torch.float32)
    kernel = quant_linear.prepare(w, torch.float32)
    assert isinstance(kernel, kind)
    got = kernel(x, bias)
    torch.testing.assert_close(got, quant_linear_ref(x, w, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,group_size,kind", CASES)
def test_bf16_is_within_bf16_rounding_of_the_reference(bits, group_size, kind):
    w, x, bias = case(bits, group_size, 16, torch.bfloat16)
    got = quant_linear.prepare(w, torch.bfloat16)(x, bias)
    want = quant_linear_ref(x, w, bias).float()
    # scales (and int4 zeros) rounded to bf16: 2^-8 relative each; the output rounded once
    magnitude = x.float().abs() @ (quant_linear_ref(torch.eye(256), w).abs()) + bias.abs()
    assert got.dtype == torch.bfloat16
    assert torch.all((got.float() - want).abs() <= 2 ** -6 * magnitude + 2 ** -7 * want.abs())


def test_prepared_bytes_are_the_ops_tensors():
    w = quantize(torch.randn(64, 128) * 0.05, 4, 32)
    kernel = quant_linear.prepare(w, torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in kernel.tensors)
    assert nbytes == kernel.packed.numel() + kernel.scales_and_zeros.numel() * 2
    assert nbytes < 64 * 128 * 2 / 3  # under a third of the bf16 matrix
