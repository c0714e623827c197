"""SwiGLU's silu(gate) * up on the CPU: one C pass (`silu_and_mul.c`) for bf16, with the
reference's numerics (each op's result rounded to bf16 where torch rounds it)."""

from __future__ import annotations

import torch

from pdserve.kernels.cpu import build
from pdserve.kernels.reference.silu_and_mul import silu_and_mul_ref


def _kernel():
    return build.function("silu_and_mul", "silu_and_mul_bf16",
                           (build.PTR, build.PTR, build.I64, build.I64))


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    kernel = _kernel()
    if kernel is None or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % 2:
        return silu_and_mul_ref(x)
    x = x.contiguous()
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    kernel(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1] // 2)
    return out
