"""SwiGLU's activation, silu(gate) * up, for the MLP's fused [gate | up] projection.

`silu_and_mul_cpu` is one C pass (`silu_and_mul_cpu.c`) for bf16, with the reference's
numerics (each op's result rounded to bf16 where torch rounds it); every other dtype, and
every other device, runs the reference: two torch ops (on CUDA, two fused elementwise kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import native


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _kernel():
    return native.function("silu_and_mul_cpu", "silu_and_mul_bf16",
                           (native.PTR, native.PTR, native.I64, native.I64))


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    kernel = _kernel()
    if kernel is None or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % 2:
        return silu_and_mul_ref(x)
    x = x.contiguous()
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    kernel(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1] // 2)
    return out
