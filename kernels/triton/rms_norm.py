"""RMSNorm with an optional fused residual add (Hugging Face LlamaRMSNorm numerics).

The residual sum is rounded to the model dtype before it is normed (as the unfused model
does), the variance is fp32, and the normed row is cast back before the weight multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import FLOAT_DTYPES, check_device, check_dtype, check_shape
from pdserve.kernels.triton.launch import new_output, pow2


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_tokens, hidden]
    new_residual_ptr,  # [num_tokens, hidden] (HAS_RESIDUAL only)
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden] (HAS_RESIDUAL only)
    weight_ptr,  # [hidden]
    eps,
    stride_x, stride_r, stride_o, stride_n,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_n + cols, x, mask=mask)
        x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / HIDDEN
    normed = (x * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (normed, new_residual); new_residual = x + residual (or x when none)."""
    check_shape("x", x, (None, None))
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("weight", weight, (x.shape[1],))
    check_dtype("weight", weight, FLOAT_DTYPES)
    if x.stride(1) != 1 or weight.stride(0) != 1:
        raise ValueError("x and weight must have stride 1 in their last dim; pass .contiguous()")
    check_device(x.device, weight=weight)
    if residual is not None:
        check_shape("residual", residual, tuple(x.shape))
        check_dtype("residual", residual, (x.dtype,))
        check_device(x.device, residual=residual)
        if residual.stride(1) != 1:
            raise ValueError("residual must have stride 1 in its last dim; pass .contiguous()")
    num_tokens, hidden = x.shape
    out = new_output(x.shape, torch.promote_types(weight.dtype, x.dtype), x.device)
    new_residual = new_output(x.shape, x.dtype, x.device) if residual is not None else x
    res = residual if residual is not None else x
    if num_tokens == 0:
        return out, new_residual
    block = pow2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        out, new_residual, x, res, weight, eps,
        x.stride(0), res.stride(0), out.stride(0), new_residual.stride(0),
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 512, 1), 8),
    )
    return out, new_residual


