"""Triton rms_norm and rotary_embedding against their torch references (interpreter).

Rotary is bit-identical to the reference in fp32 and fp16 (same roundings at the same places).
rms_norm sums in another order, so its fp32 rsqrt may differ in the last bits: within 8 fp32
steps, or 2 steps of fp16 (a flipped final rounding). bf16 goes by upcast: the interpreter
truncates to bf16 where a GPU rounds to nearest, at every rounding the kernels emulate, so bf16
outputs are held to a relative norm error of 1e-2 against the reference computed in fp32 on
the same bf16 inputs (bf16 keeps 8 significant bits: one truncation costs up to 2**-7).
"""

from __future__ import annotations

import pytest
import torch
from paged_case import rel_err

from pdserve.kernels.reference.rms_norm import rms_norm_ref
from pdserve.kernels.reference.rotary_embedding import rotary_embedding_ref
from pdserve.kernels.triton.rms_norm import rms_norm
from pdserve.kernels.triton.rotary_embedding import rotary_embedding

EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
STEPS = {torch.float32: 8, torch.float16: 2}


def _close(out, ref, dtype):
    """Elementwise within STEPS[dtype] representable steps of the reference value."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any()
    tol = STEPS[dtype] * EPS[dtype] * ref.float().abs() + 1e-30
    assert ((out.float() - ref.float()).abs() <= tol).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 64])  # SmolLM2-135M's width is not a power of two
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, hidden, with_residual):
    x = torch.randn(7, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    residual = torch.randn(7, hidden).to(dtype) if with_residual else None
    out, new_residual = rms_norm(x, weight, 1e-5, residual)
    if dtype == torch.bfloat16:
        up = None if residual is None else residual.float()
        ref, ref_residual = rms_norm_ref(x.float(), weight.float(), 1e-5, up)
        assert out.dtype == dtype and new_residual.dtype == dtype
        assert rel_err(out, ref) < 1e-2 and rel_err(new_residual, ref_residual) < 1e-2
        return
    ref, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
    _close(out, ref, dtype)
    assert torch.equal(new_residual, ref_residual)  # the sum rounds exactly like torch's


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 1, 128)])
def test_rotary_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    max_pos = 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # HF's layout: halves duplicated
    cos, sin = emb.cos(), emb.sin()
    positions = torch.randint(0, max_pos, (11,))
    qkv = torch.randn(11, num_heads + 2 * num_kv_heads, head_dim).to(dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]  # strided views
    upcast = torch.float32 if dtype == torch.bfloat16 else dtype
    q_ref, k_ref = q.to(upcast), k.to(upcast)
    rotary_embedding(q, k, positions, cos, sin)
    rotary_embedding_ref(q_ref, k_ref, positions, cos, sin)
    if dtype == torch.bfloat16:
        assert rel_err(q, q_ref) < 1e-2 and rel_err(k, k_ref) < 1e-2
    else:
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert not torch.equal(q, qkv[:, :num_heads].clone().zero_())  # rotated, in place


def test_rms_norm_rejects_wrong_weight():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 64), torch.randn(32), 1e-6)
