"""The C rms_norm and rotary_embedding (`kernels/cpu/*.c`) against their torch references.

Rotary rounds where the reference rounds: bit-identical in fp32 and bf16. rms_norm sums the
squares in another order, so its fp32 rsqrt may differ in the last bits: within 8 fp32 steps,
or 2 bf16 steps (the normed value's rounding flips, and then the weight product's); the
residual sum is exact (one rounding, same place).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu.rms_norm import rms_norm_cpu
from pdserve.kernels.cpu.rotary_embedding import rotary_embedding_cpu
from pdserve.kernels.reference.rms_norm import rms_norm_ref
from pdserve.kernels.reference.rotary_embedding import rotary_embedding_ref

STEP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}
STEPS = {torch.float32: 8, torch.bfloat16: 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 100])  # 100: split over the OpenMP threads
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, rows, with_residual):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    residual = torch.randn(rows, 576, generator=gen).to(dtype) if with_residual else None
    out, new_residual = rms_norm_cpu(x, weight, 1e-5, residual)
    ref, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, ref_residual)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = STEPS[dtype] * STEP[dtype] * ref.float().abs() + 1e-30
    assert ((out.float() - ref.float()).abs() <= tol).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 80])
def test_rotary_is_bit_identical_on_a_fused_qkv_view(dtype, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (9 + 2 * 3) * 64, generator=gen).to(dtype)
    positions = torch.randint(0, 500, (num_tokens,), generator=gen)
    angles = torch.randn(512, 32, generator=gen)
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    ours, ref = qkv.clone(), qkv.clone()
    for t, run in ((ours, rotary_embedding_cpu), (ref, rotary_embedding_ref)):
        q = t[:, : 9 * 64].view(num_tokens, 9, 64)  # token stride (9 + 6) * 64
        k = t[:, 9 * 64 : 12 * 64].view(num_tokens, 3, 64)
        run(q, k, positions, cos, sin)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, qkv)  # it rotated something (and left v alone)
    assert torch.equal(ours[:, 12 * 64 :], qkv[:, 12 * 64 :])


def test_other_dtypes_fall_back_to_the_reference():
    x = torch.randn(3, 64).half()
    w = torch.ones(64).half()
    out, _ = rms_norm_cpu(x, w, 1e-5)
    assert torch.equal(out, rms_norm_ref(x, w, 1e-5)[0])
