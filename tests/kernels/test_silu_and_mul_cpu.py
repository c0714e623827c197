"""The C silu_and_mul (`kernels/cpu/silu_and_mul.c`) against its torch reference.

bf16: the sigmoid's exp is within ~1 fp32 ulp of torch's, so a rounding to bf16 may flip: each
output within 2 bf16 steps of the reference (silu's rounding, then the product's), and nearly
all of them identical. Other dtypes run the reference itself: identical.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu.silu_and_mul import silu_and_mul_cpu
from pdserve.kernels.reference.silu_and_mul import silu_and_mul_ref


@pytest.mark.parametrize("rows", [1, 7, 100])  # 100: split over the OpenMP threads
def test_bf16_matches_reference(rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 1536, generator=gen) * 4).bfloat16()
    x[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 88.0, -88.0, 1e-3, -1e-3]).bfloat16()
    out, ref = silu_and_mul_cpu(x), silu_and_mul_ref(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 1536)
    tol = 2 * 2.0**-7 * ref.float().abs() + 1e-30
    assert ((out.float() - ref.float()).abs() <= tol).all()
    assert (out == ref).float().mean() > 0.99


def test_strided_input_and_other_dtypes():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2 * 64, generator=gen).bfloat16()[::2]  # rows 256 elements apart
    assert not x.is_contiguous()
    assert torch.equal(silu_and_mul_cpu(x), silu_and_mul_cpu(x.contiguous()))
    y = torch.randn(5, 2 * 64, generator=gen)
    assert torch.equal(silu_and_mul_cpu(y), silu_and_mul_ref(y))  # fp32: the reference
