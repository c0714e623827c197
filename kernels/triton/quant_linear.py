"""Linear layer on a weight-only quantized matrix (`quant_weights`): y = x @ W.T (+ bias).

The Triton kernel tiles [T, out] and never materialises W. Per group it feeds the raw integer
weights to `tl.dot` (int8 values, or int4 nibbles split into even and odd input columns) and
applies that group's fp32 scale to the fp32 partial sum afterwards; int4's offset adds
offset * sum(x over the group). Integers up to 127 are exact in fp16 and bf16, so on a GPU the
dot runs in x's half type on the tensor cores with no rounding of the weights, fp32 x in fp32
(IEEE), and the interpreter in fp32 (`launch.dot_dtype`). Accumulation is fp32; the output is
x.dtype.

Constraint: a K block never straddles two groups, and `tl.dot` needs K >= 16 per operand, so
group_size must be a multiple of 16 (int8) or 32 (int4: each nibble half is a K of 16+).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_contiguous,
    check_shape,
)
from pdserve.kernels.quant_weights import QuantizedWeight
from pdserve.kernels.triton.launch import dot_dtype, dot_precision, new_output, pow2

MIN_GROUP = {8: 16, 4: 32}  # smallest group (and K block) per bit width
MAX_BLOCK_K = 64


@triton.jit
def quant_tile(
    x_rows,  # [BLOCK_M, 1] pointers: each row's start in x
    row_mask,  # [BLOCK_M]
    w_cols,  # [1, BLOCK_N] pointers: each output column's row of the integer weights
    col_mask,  # [BLOCK_N]
    s_cols,  # [BLOCK_N] pointers: each column's scales, one per group
    z_cols,  # [BLOCK_N] pointers: each column's offsets (INT4 only)
    num_groups,
    GROUP_SIZE: tl.constexpr, INT4: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of x @ dequantize(w).T in fp32 (the module doc's method);
    also the quantized experts' grouped GEMM's (`kernels.triton.fused_moe`)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, num_groups):
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, GROUP_SIZE, BLOCK_K):
            k = g * GROUP_SIZE + k0
            if INT4:
                half = tl.arange(0, BLOCK_K // 2)
                packed = tl.load(w_cols + (k // 2 + half)[:, None], mask=col_mask[None, :],
                                 other=0)
                low = (packed & 0xF).to(tl.float32).to(DOT)
                high = (packed >> 4).to(tl.float32).to(DOT)
                even = x_rows + (k + 2 * half)[None, :]
                x_even = tl.load(even, mask=row_mask[:, None], other=0.0).to(tl.float32)
                x_odd = tl.load(even + 1, mask=row_mask[:, None], other=0.0).to(tl.float32)
                part += tl.dot(x_even.to(DOT), low, input_precision=PRECISION)
                part += tl.dot(x_odd.to(DOT), high, input_precision=PRECISION)
                x_sum += tl.sum(x_even, axis=1) + tl.sum(x_odd, axis=1)
            else:
                ks = k + tl.arange(0, BLOCK_K)
                q = tl.load(w_cols + ks[:, None], mask=col_mask[None, :], other=0)
                x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None], other=0.0)
                part += tl.dot(x.to(tl.float32).to(DOT), q.to(tl.float32).to(DOT),
                               input_precision=PRECISION)
        scale = tl.load(s_cols + g, mask=col_mask, other=0.0)
        acc += part * scale[None, :]
        if INT4:
            offset = tl.load(z_cols + g, mask=col_mask, other=0.0)
            acc += x_sum[:, None] * offset[None, :]
    return acc


@triton.jit
def _quant_linear_kernel(
    out_ptr,  # [T, N]
    x_ptr,  # [T, K]
    qweight_ptr,  # [N, K] int8, or [N, K / 2] uint8 (INT4)
    scales_ptr,  # [N, K / GROUP_SIZE] fp32
    offsets_ptr,  # [N, K / GROUP_SIZE] fp32 (INT4 only)
    bias_ptr,  # [N] (HAS_BIAS only)
    num_tokens, out_features, num_groups,
    stride_x, stride_o, stride_q, stride_s, stride_z,
    GROUP_SIZE: tl.constexpr, INT4: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_tokens
    col_mask = cols < out_features
    acc = quant_tile(
        x_ptr + rows.to(tl.int64)[:, None] * stride_x, row_mask,
        qweight_ptr + cols.to(tl.int64)[None, :] * stride_q, col_mask,
        scales_ptr + cols.to(tl.int64) * stride_s, offsets_ptr + cols.to(tl.int64) * stride_z,
        num_groups, GROUP_SIZE, INT4, BLOCK_M, BLOCK_N, BLOCK_K, DOT, PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def block_k(group_size: int) -> int:
    """The K block: the largest power of two dividing group_size, at most MAX_BLOCK_K."""
    return min(group_size & -group_size, MAX_BLOCK_K)


def _check_args(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> None:
    if not isinstance(w, QuantizedWeight):
        raise ValueError(f"w must be a QuantizedWeight, got {type(w).__name__}")
    check_shape("x", x, (None, w.in_features))
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_contiguous("x", x)
    minimum = MIN_GROUP[w.bits]
    if w.group_size % minimum:
        raise ValueError(f"w.group_size {w.group_size} must be a multiple of {minimum} for the "
                         f"int{w.bits} kernel (tl.dot needs K >= 16); use quant_linear_ref")
    tensors = {"w.qweight": w.qweight, "w.scales": w.scales}
    if w.offsets is not None:
        tensors["w.offsets"] = w.offsets
    if bias is not None:
        check_shape("bias", bias, (w.out_features,))
        check_dtype("bias", bias, FLOAT_DTYPES)
        tensors["bias"] = bias
    for name, t in tensors.items():
        check_last_contiguous(name, t)
    check_device(x.device, **tensors)


def quant_linear(
    x: torch.Tensor,  # [T, in_features], fp32 / fp16 / bf16
    w: QuantizedWeight,  # [out_features, in_features], int8 or int4
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [T, out_features], x.dtype
    """x @ dequantize(w).T (+ bias) without dequantizing w; see the module doc."""
    _check_args(x, w, bias)
    num_tokens, out_features = x.shape[0], w.out_features
    out = new_output((num_tokens, out_features), x.dtype, x.device)
    if num_tokens == 0 or out_features == 0:
        return out
    block_m = min(pow2(num_tokens, 16), 64)
    block_n = 32 if block_m == 16 else 64  # decode: more programs over the weight rows
    dot = dot_dtype(torch.int8, x.dtype)
    offsets = w.offsets if w.offsets is not None else w.scales
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(out_features, block_n))
    _quant_linear_kernel[grid](
        out, x, w.qweight, w.scales, offsets, bias if bias is not None else x,
        num_tokens, out_features, w.in_features // w.group_size,
        x.stride(0), out.stride(0), w.qweight.stride(0), w.scales.stride(0),
        offsets.stride(0),
        GROUP_SIZE=w.group_size, INT4=w.bits == 4, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k(w.group_size),
        DOT=dot, PRECISION=dot_precision(dot),
    )
    return out




def supported(w: QuantizedWeight) -> bool:
    """Whether the kernel takes `w`'s groups (`MIN_GROUP`); the reference takes any."""
    return w.group_size % MIN_GROUP[w.bits] == 0


@dataclass(frozen=True)
class QuantLinear:
    """A quantized weight as it is (`quant_weights` layout), run by `quant_linear`."""

    weight: QuantizedWeight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return quant_linear(x, self.weight, bias)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        w = self.weight
        return (w.qweight, w.scales) + ((w.offsets,) if w.offsets is not None else ())
