"""RMSNorm (+ fused residual add) on the CPU: one C pass per row (`rms_norm.c`), with the
reference's numerics (`kernels.reference.rms_norm`)."""

from __future__ import annotations

import torch

from pdserve.kernels.checks import check_shape
from pdserve.kernels.cpu import build
from pdserve.kernels.reference.rms_norm import rms_norm_ref

_CPU_SIGNATURE = (build.PTR,) * 5 + (build.I64, build.I64, build.FLOAT, build.INT)


def _kernel():
    return build.function("rms_norm", "rms_norm", _CPU_SIGNATURE)


def rms_norm_cpu(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_ref` in one C pass per row (`rms_norm.c`); other dtypes go to the ref."""
    kernel = _kernel()
    dtype = str(x.dtype).removeprefix("torch.")
    plain = residual is None or (residual.dtype == x.dtype and residual.is_contiguous())
    if kernel is None or dtype not in build.DTYPE_CODES or weight.dtype != x.dtype or not plain:
        return rms_norm_ref(x, weight, eps, residual)
    check_shape("x", x, (None, weight.shape[0]))
    if residual is not None:
        check_shape("residual", residual, tuple(x.shape))
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else x
    kernel(x.data_ptr(), residual.data_ptr() if residual is not None else None,
           weight.data_ptr(), out.data_ptr(),
           new_residual.data_ptr() if residual is not None else None,
           x.shape[0], x.shape[1], eps, build.DTYPE_CODES[dtype])
    return out, new_residual
