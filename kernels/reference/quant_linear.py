"""Linear layer on a weight-only quantized matrix (`kernels.quant_weights`), in plain torch."""

from __future__ import annotations

import torch

from pdserve.kernels.quant_weights import QuantizedWeight, dequantize


def quant_linear_ref(
    x: torch.Tensor,  # [T, in_features], any float dtype
    w: QuantizedWeight,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [T, out_features], x.dtype
    """x @ dequantize(w).T (+ bias), computed in fp32 and cast to x.dtype."""
    y = x.float() @ dequantize(w).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
