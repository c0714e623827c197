"""Linear layers as the `torch` backend runs them: a prepared weight and its matmul in one object.

A backend's `prepare_linears` turns each linear's loaded weight (a dense tensor, or a
`QuantizedWeight`) into a `LinearKernel` (`kernels.backend`): an object holding the weight in
the layout its kernel reads, called as `kernel(x, bias)`. The kernel is chosen there, once, at
load; a step only calls the object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.quant_weights import QuantizedWeight
from pdserve.kernels.reference.quant_linear import quant_linear_ref


@dataclass(frozen=True)
class DenseLinear:
    """y = x W^T (+ b) by torch's matmul (MKL on a CPU, cuBLAS on a GPU): the fp32 path is
    the exact-parity one, token-identical to transformers."""

    weight: torch.Tensor  # [out, in]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.weight,)


@dataclass(frozen=True)
class QuantLinearRef:
    """A weight-only quantized linear, dequantized per call (`quant_linear_ref`)."""

    weight: QuantizedWeight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return quant_linear_ref(x, self.weight, bias)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        w = self.weight
        return (w.qweight, w.scales) + ((w.offsets,) if w.offsets is not None else ())
