"""Triton quant_linear against quant_linear_ref (interpreter), int4 and int8 layouts.

Weights are random bytes (every nibble and int8 value occurs) with random positive scales and
signed offsets, so nothing cancels to zero by construction. The kernel sums in another order
and splits int4's w = s*q + o into s*sum(x*q) + o*sum(x), so each output is held to
TOL * mag, where mag = |x| @ (|s*q| + |o|).T bounds every partial sum (TOL = 2**-20; seen:
1.2e-7, about two fp32 roundings). bf16: the interpreter computes the dot in fp32 and truncates
the final cast where a GPU rounds to nearest, so bf16 outputs are held to one bf16 step
(2**-7 relative) of the fp32 reference on the same bf16 inputs, plus the fp32 term; fp16 to
one fp16 step (2**-10).
"""

from __future__ import annotations

import re

import pytest
import torch

from pdserve.kernels.quant_weights import QuantizedWeight, quantize, unpack_int4
from pdserve.kernels.reference.quant_linear import quant_linear_ref
from pdserve.kernels.triton.quant_linear import quant_linear

IN, OUT = 256, 80  # OUT is not a multiple of the 32- or 64-wide column block
TOL = 2.0**-20
STEP = {torch.float32: 0.0, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
LAYOUTS = [(4, 32), (4, 64), (4, 128), (8, IN), (8, 32)]  # (bits, group_size)


def _weight(bits: int, group: int, out: int = OUT, cols: int = IN) -> QuantizedWeight:
    groups = (out, cols // group)
    scales = 0.01 + 0.04 * torch.rand(groups)
    if bits == 8:
        q = torch.randint(-127, 128, (out, cols), dtype=torch.int8)
        return QuantizedWeight(8, group, q, scales)
    packed = torch.randint(0, 256, (out, cols // 2), dtype=torch.uint8)
    return QuantizedWeight(4, group, packed, scales, 0.3 * torch.randn(groups))


def _magnitude(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    q = (unpack_int4(w.qweight) if w.bits == 4 else w.qweight).float()
    mag = (q.view(w.out_features, -1, w.group_size) * w.scales[..., None]).abs()
    if w.offsets is not None:
        mag = mag + w.offsets.abs()[..., None]
    return x.float().abs() @ mag.view(w.shape).T


def _check(out, x, w, bias):
    ref = quant_linear_ref(x.float(), w, bias)  # fp32 oracle on the same (rounded) inputs
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any()  # every poisoned element was written
    mag = _magnitude(x, w) + (0.0 if bias is None else bias.float().abs())
    tol = TOL * mag + STEP[x.dtype] * ref.abs()
    assert ((out.float() - ref).abs() <= tol).all(), float((out.float() - ref).abs().max())


@pytest.mark.parametrize("bits,group", LAYOUTS)
@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_matches_reference(bits, group, tokens, dtype):
    torch.manual_seed(bits * 1000 + group + tokens)
    w = _weight(bits, group)
    x = torch.randn(tokens, IN).to(dtype)
    bias = torch.randn(OUT).to(dtype) if tokens != 5 else None  # T=5 runs without bias
    _check(quant_linear(x, w, bias), x, w, bias)


@pytest.mark.parametrize("bits,group", [(4, 32), (8, IN)])
def test_quant_linear_fp16_bias_and_strided_views(bits, group):
    """fp16 x, an fp32 bias, a row-strided x and a row shard of w (narrow keeps strides)."""
    torch.manual_seed(7)
    full = _weight(bits, group, out=OUT + 16)
    w = full.narrow(0, 16, OUT)
    x = torch.randn(9, 2 * IN).to(torch.float16)[:, :IN]  # stride(0) = 2 * IN
    bias = torch.randn(OUT)
    _check(quant_linear(x, w, bias), x, w, bias)


def test_quant_linear_column_shard():
    """A tensor-parallel input shard: qweight and scales are views with wider rows."""
    torch.manual_seed(3)
    w = _weight(4, 32, cols=2 * IN).narrow(1, IN, IN)
    x = torch.randn(3, IN)
    _check(quant_linear(x, w), x, w, None)


def test_quant_linear_no_tokens():
    out = quant_linear(torch.randn(0, IN), _weight(8, IN))
    assert out.shape == (0, OUT)


def test_reference_tracks_the_float_matrix():
    """quant_linear_ref on `quantize`d weights stays near the unquantized product."""
    torch.manual_seed(1)
    weight, x = torch.randn(OUT, IN), torch.randn(4, IN)
    exact = x @ weight.T
    for bits, group, bound in ((8, 0, 0.02), (4, 32, 0.15)):
        got = quant_linear_ref(x, quantize(weight, bits, group))
        assert ((got - exact).norm() / exact.norm()) < bound


def _bad(**change):
    args = {"x": torch.randn(2, IN), "w": _weight(4, 32), "bias": None} | change
    return args


@pytest.mark.parametrize("name,args", [
    ("x", _bad(x=torch.randn(2, IN + 32))),
    ("x", _bad(x=torch.randn(2, 1, IN))),
    ("x", _bad(x=torch.randint(0, 5, (2, IN)))),
    ("x", _bad(x=torch.randn(IN, 2).T)),
    ("w", _bad(w=torch.randn(OUT, IN))),
    ("w.group_size", _bad(w=_weight(4, 16))),
    ("w.group_size", _bad(w=_weight(8, 8))),
    ("w.qweight", _bad(w=QuantizedWeight(8, IN, torch.zeros(IN, OUT, dtype=torch.int8).T,
                                         torch.ones(OUT, 1)))),
    ("bias", _bad(bias=torch.randn(OUT + 1))),
    ("bias", _bad(bias=torch.ones(OUT, dtype=torch.int32))),
    ("bias", _bad(bias=torch.randn(OUT, device="meta"))),
])
def test_quant_linear_rejects_bad_arguments(name, args):
    with pytest.raises(ValueError, match=rf"^{re.escape(name)} "):
        quant_linear(**args)
