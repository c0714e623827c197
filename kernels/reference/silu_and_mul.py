"""SwiGLU's activation, silu(gate) * up, for the MLP's fused [gate | up] projection: two
torch ops (on CUDA, two fused elementwise kernels, which is what the `triton` backend runs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


