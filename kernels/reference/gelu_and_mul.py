"""GeGLU's activation, gelu_tanh(gate) * up, for Gemma's fused [gate | up] projection
(transformers' `gelu_pytorch_tanh`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
