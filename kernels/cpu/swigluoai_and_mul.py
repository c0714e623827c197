"""gpt-oss's gated activation ("swigluoai") on the CPU: one C pass (`swigluoai_and_mul.c`) for
bf16, with the reference's numerics (fp32, rounded once); the reference elsewhere."""

from __future__ import annotations

import torch

from pdserve.kernels.cpu import build
from pdserve.kernels.reference.swigluoai_and_mul import (
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    swigluoai_and_mul_ref,
)


def _kernel():
    return build.function("swigluoai_and_mul", "swigluoai_and_mul_bf16",
                          (build.PTR, build.PTR, build.I64, build.I64, build.FLOAT, build.FLOAT))


def swigluoai_and_mul_cpu(x: torch.Tensor, alpha: float = SWIGLU_ALPHA,
                          limit: float = SWIGLU_LIMIT) -> torch.Tensor:  # [T, 2I] -> [T, I]
    kernel = _kernel()
    if kernel is None or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % 2:
        return swigluoai_and_mul_ref(x, alpha, limit)
    x = x.contiguous()
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    kernel(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1] // 2, alpha, limit)
    return out
