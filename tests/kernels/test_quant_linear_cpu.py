"""The CPU's weight-only quantized linears (torch's packed ops) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import quant_linear_cpu
from pdserve.kernels.quant_linear import quant_linear_ref
from pdserve.kernels.quant_weights import quantize

CASES = [(4, 32, "int4"), (4, 64, "int4"), (4, 128, "int4"), (8, 0, "int8"),
         (8, 32, "reference")]


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
    prepared = quant_linear_cpu.prepare(w, torch.float32)
    assert prepared.kind == kind
    got = quant_linear_cpu.linear(x, prepared, bias)
    torch.testing.assert_close(got, quant_linear_ref(x, w, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,group_size,kind", CASES)
def test_bf16_is_within_bf16_rounding_of_the_reference(bits, group_size, kind):
    w, x, bias = case(bits, group_size, 16, torch.bfloat16)
    got = quant_linear_cpu.linear(x, quant_linear_cpu.prepare(w, torch.bfloat16), bias)
    want = quant_linear_ref(x, w, bias).float()
    # scales (and int4 zeros) rounded to bf16: 2^-8 relative each; the output rounded once
    magnitude = x.float().abs() @ (quant_linear_ref(torch.eye(256), w).abs()) + bias.abs()
    assert got.dtype == torch.bfloat16
    assert torch.all((got.float() - want).abs() <= 2 ** -6 * magnitude + 2 ** -7 * want.abs())


def test_prepared_bytes_are_the_ops_tensors():
    w = quantize(torch.randn(64, 128) * 0.05, 4, 32)
    prepared = quant_linear_cpu.prepare(w, torch.bfloat16)
    assert prepared.nbytes == prepared.packed.numel() + prepared.scales.numel() * 2
    assert prepared.nbytes < 64 * 128 * 2 / 3  # under a third of the bf16 matrix
