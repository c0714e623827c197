"""A MoE layer's experts as two grouped GEMMs (`fused_moe_ref`'s op; vLLM/SGLang's design).

The (token, slot) pairs are sorted by expert and each expert's run padded to BLOCK_M rows
(`moe_align`, torch ops, no host sync), so every BLOCK_M-row block of the sorted list belongs
to one expert. One kernel, `_moe_gemm_kernel`, launched twice over (block, column tile):

1. gate/up: x's rows gathered by token, times the block's expert's gate rows and up rows (two
   fp32 accumulators), silu(gate) * up in fp32, stored per pair in x's dtype: act [T * k, I];
2. down: act's rows times the expert's w2, times the pair's routing weight (fp32), stored per
   pair: [T * k, H];

then the k slots of each token are summed in torch (fp32 inside the reduction, rounded once),
slots of experts another rank holds (`expert_start`) masked out. Blocks past the padded total
(the grid is sized for the worst case) return at once; padding rows are masked.

Numerics against the reference: the same GEMMs with fp32 accumulation, but gate and up are not
rounded to x's dtype before SiLU * up, and each slot's weighted output is rounded to x's dtype
before the sum over slots (the reference sums in fp32): in bf16, a few bf16 steps apart.

gpt-oss's experts (`ExpertVariant`, constexpr flags: off, the kernel is the one without them):
biases (`HAS_BIAS`) added to the fp32 sums, gate's and up's before the activation, down's
before the routing weight; the "swigluoai" activation (`ACTIVATION` 1) in fp32 in place of
SiLU * up.

Quantized experts (lists of `QuantizedWeight`, one bit width and group size) are stacked
(`StackedQuantized`) and run by the same kernel (`QUANT` 8 or 4): each tile is the quantized
linear kernel's (`quant_linear.quant_tile`: raw integers into `tl.dot`, each group's scale and
int4's offset applied to its fp32 partial sum), with the same routing, activation and biases;
no host sync, so a decode step with quantized experts is captured in a CUDA graph like a dense
one. Groups the kernel does not take (`quant_linear.supported`), or experts of mixed widths,
run one expert at a time on `LinearExperts` (one host sync per layer: eager only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_contiguous,
)
from pdserve.kernels.quant_weights import QuantizedWeight
from pdserve.kernels.reference.fused_moe import (
    ExpertVariant,
    LinearExperts,
    check_routing,
    expert_shapes,
    local_ids,
    moe_align,
)
from pdserve.kernels.reference.linear import QuantLinearRef
from pdserve.kernels.reference.swigluoai_and_mul import SWIGLU_ALPHA, SWIGLU_LIMIT
from pdserve.kernels.triton.launch import dot_dtype, dot_precision, new_output, pow2
from pdserve.kernels.triton.quant_linear import QuantLinear, block_k, quant_tile, supported


@triton.jit
def _moe_gemm_kernel(
    c_ptr,  # [T * k, N]: row = pair
    a_ptr,  # GATED: x [T, K]; else act [T * k, K]; row = pair // A_ROW_DIV
    b_ptr,  # [E, N, K]; GATED: w13 [E, 2 * N, K], gate rows then up rows; QUANT: the integers
    # (int8 [E, N, K], int4 uint8 [E, N, K / 2], `quant_weights` layout per expert)
    scales_ptr,  # QUANT: [E, N (GATED: 2 * N), K / GROUP_SIZE] fp32
    offsets_ptr,  # QUANT 4: as scales_ptr
    bias_ptr,  # HAS_BIAS: [E, N]; GATED: [E, 2 * N], gate then up
    weights_ptr,  # [T * k] fp32 routing weights (WEIGHTED only)
    sorted_ids_ptr,  # [num_blocks * BLOCK_M] pair, num_pairs = padding
    block_experts_ptr,  # [num_blocks] local expert, -1 = unused block
    num_pairs, n, k,
    stride_a, stride_c, stride_be, stride_bn, stride_se, stride_sn, stride_bias,
    swiglu_alpha, swiglu_limit,  # ACTIVATION 1 only
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,  # 0: SiLU * up, 1: swigluoai
    QUANT: tl.constexpr, GROUP_SIZE: tl.constexpr,  # QUANT 0: dense; 8 or 4: the bit width
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    pairs = tl.load(sorted_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    a_rows = a_ptr + (pairs // A_ROW_DIV)[:, None] * stride_a
    b_cols = b_ptr + expert.to(tl.int64) * stride_be + cols.to(tl.int64)[None, :] * stride_bn
    if QUANT:  # gate (or down) columns, then up's n rows further on
        s_cols = expert.to(tl.int64) * stride_se + cols.to(tl.int64) * stride_sn
        acc = quant_tile(a_rows, row_mask, b_cols, col_mask, scales_ptr + s_cols,
                         offsets_ptr + s_cols, k // GROUP_SIZE, GROUP_SIZE, QUANT == 4,
                         BLOCK_M, BLOCK_N, BLOCK_K, DOT, PRECISION)
        if GATED:
            s_up = s_cols + n * stride_sn
            up = quant_tile(a_rows, row_mask, b_cols + n * stride_bn, col_mask,
                            scales_ptr + s_up, offsets_ptr + s_up, k // GROUP_SIZE, GROUP_SIZE,
                            QUANT == 4, BLOCK_M, BLOCK_N, BLOCK_K, DOT, PRECISION)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a_mask = row_mask[:, None] & (ks < k)[None, :]
            b_mask = (ks < k)[:, None] & col_mask[None, :]
            a = tl.load(a_rows + ks[None, :], mask=a_mask, other=0.0).to(tl.float32).to(DOT)
            b = tl.load(b_cols + ks[:, None], mask=b_mask, other=0.0).to(tl.float32).to(DOT)
            acc += tl.dot(a, b, input_precision=PRECISION)
            if GATED:
                b_up = tl.load(b_cols + n * stride_bn + ks[:, None], mask=b_mask, other=0.0)
                up += tl.dot(a, b_up.to(tl.float32).to(DOT), input_precision=PRECISION)
    if HAS_BIAS:  # the expert's bias row: its gate (or down) columns, then its up columns
        bias_row = bias_ptr + expert.to(tl.int64) * stride_bias + cols
        acc += tl.load(bias_row, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            up += tl.load(bias_row + n, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if ACTIVATION == 1:  # swigluoai: (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, L)
            gate = tl.minimum(acc, swiglu_limit)
            up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
            acc = (up + 1.0) * (gate / (1.0 + tl.exp(-swiglu_alpha * gate)))
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * up  # silu(gate) * up
    if WEIGHTED:
        acc *= tl.load(weights_ptr + pairs, mask=row_mask, other=0.0)[:, None]
    dst = c_ptr + pairs[:, None] * stride_c + cols[None, :]
    tl.store(dst, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@dataclass(frozen=True)
class StackedQuantized:
    """E experts' `QuantizedWeight`s of one shape, bit width and group size, stacked: qweight
    [E, N, K] int8 or [E, N, K / 2] uint8, scales and offsets (int4) [E, N, K / group] fp32."""

    bits: int
    group_size: int
    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None

    @classmethod
    def stack(cls, ws: Sequence[QuantizedWeight]) -> StackedQuantized | None:
        """None where the kernel cannot take them: groups it does not take, or mixed kinds."""
        kinds = {(w.bits, w.group_size, w.shape) for w in ws}
        if len(kinds) != 1 or not supported(ws[0]):
            return None
        offsets = None if ws[0].offsets is None else torch.stack([w.offsets for w in ws])
        return cls(ws[0].bits, ws[0].group_size, torch.stack([w.qweight for w in ws]),
                   torch.stack([w.scales for w in ws]), offsets)

    @property
    def shape(self) -> tuple[int, int, int]:  # [E, N, K], as the dense weights'
        num, out, cols = self.qweight.shape
        return num, out, cols * (2 if self.bits == 4 else 1)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.qweight, self.scales) + (() if self.offsets is None else (self.offsets,))


Experts = torch.Tensor | StackedQuantized  # what the grouped GEMMs take


def _check_args(x, w13, w2, topk_weights, topk_ids) -> None:
    if isinstance(w13, StackedQuantized):
        check_routing(x, topk_weights, topk_ids, w13.shape[2])
        check_dtype("x", x, FLOAT_DTYPES)
        check_last_contiguous("x", x)
        check_device(x.device, topk_weights=topk_weights, topk_ids=topk_ids,
                     **{f"{name}.{i}": t for name, w in (("w13", w13), ("w2", w2))
                        for i, t in enumerate(w.tensors)})
        return
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
        raise ValueError("w13 and w2 must be dense tensors; quantized experts run on "
                         "prepare_quantized_experts")
    _, hidden, _ = expert_shapes(w13, w2)
    check_routing(x, topk_weights, topk_ids, hidden)
    check_dtype("w13", w13, FLOAT_DTYPES)
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"w13 and w2 must have x's dtype {x.dtype}, got {w13.dtype} and "
                         f"{w2.dtype}; prepare them with KernelBackend.prepare_experts")
    for name, t in {"x": x, "w13": w13, "w2": w2}.items():
        check_last_contiguous(name, t)
    check_device(x.device, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)


def _tiles(num_pairs: int, num_experts: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16-row blocks where an expert gets a few pairs (decode),
    64 where many; tl.dot needs 16 or more on each side."""
    block_m = 16 if num_pairs <= 16 * num_experts else 64
    return block_m, min(pow2(n, 16), 64), min(pow2(k, 16), 64)


def _grouped_gemm(c, a, b: Experts, bias, weights, align, num_pairs, top_k, gated: bool,
                  variant: ExpertVariant) -> None:
    n, k = c.shape[1], a.shape[1]
    _, block_n, block_k_dense = _tiles(num_pairs, b.shape[0], n, k)
    if isinstance(b, StackedQuantized):
        ints, scales, quant, group = b.qweight, b.scales, b.bits, b.group_size
        offsets = scales if b.offsets is None else b.offsets
        tile_k, dot = block_k(group), dot_dtype(torch.int8, a.dtype)
    else:
        ints = scales = offsets = b  # scales and offsets unread
        quant, group = 0, 1
        tile_k, dot = block_k_dense, dot_dtype(a.dtype, a.dtype)
    grid = (align.block_experts.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        c, a, ints, scales, offsets, ints if bias is None else bias, weights, align.sorted_ids,
        align.block_experts, num_pairs, n, k,
        a.stride(0), c.stride(0), ints.stride(0), ints.stride(1), scales.stride(0),
        scales.stride(1), 0 if bias is None else bias.stride(0),
        variant.swiglu_alpha, variant.swiglu_limit,
        A_ROW_DIV=top_k if gated else 1, GATED=gated, WEIGHTED=not gated,
        HAS_BIAS=bias is not None, ACTIVATION=int(variant.activation == "swigluoai"),
        QUANT=quant, GROUP_SIZE=group,
        BLOCK_M=align.block_m, BLOCK_N=block_n, BLOCK_K=tile_k,
        DOT=dot, PRECISION=dot_precision(dot),
    )


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H] (gate rows, then up rows), x.dtype
    w2: torch.Tensor,  # [E, H, I], x.dtype
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int64 (or int32), global expert ids
    *,
    expert_start: int = 0,
    w13_bias: torch.Tensor | None = None,  # [E, 2 * I]: gate, then up
    w2_bias: torch.Tensor | None = None,  # [E, H]
    activation: str = "silu",  # or "swigluoai" (gpt-oss)
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
) -> torch.Tensor:  # [T, H], x.dtype
    """`fused_moe_ref` as two grouped GEMMs and a sum over the slots (module doc)."""
    variant = ExpertVariant(w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit)
    return _fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start, variant)


def _fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start: int,
               variant: ExpertVariant) -> torch.Tensor:
    _check_args(x, w13, w2, topk_weights, topk_ids)
    num_experts, hidden, inter = w13.shape[0], w13.shape[2], w13.shape[1] // 2
    variant = variant.checked(num_experts, hidden, inter, x.dtype)
    check_device(x.device, **{name: b for name, b in
                              (("w13_bias", variant.w13_bias), ("w2_bias", variant.w2_bias))
                              if b is not None})
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros(num_tokens, hidden, dtype=x.dtype, device=x.device)
    block_m, _, _ = _tiles(num_pairs, num_experts, inter, hidden)
    align = moe_align(topk_ids, num_experts, block_m, expert_start)
    weights = topk_weights.reshape(-1).contiguous()  # [T * k]
    act = new_output((num_pairs, inter), x.dtype, x.device)  # [T * k, I]
    _grouped_gemm(act, x, w13, variant.w13_bias, weights, align, num_pairs, top_k, True,
                  variant)
    per_slot = new_output((num_pairs, hidden), x.dtype, x.device)  # [T * k, H]
    _grouped_gemm(per_slot, act, w2, variant.w2_bias, weights, align, num_pairs, top_k, False,
                  variant)
    local = local_ids(topk_ids, num_experts, expert_start) != num_experts  # [T * k]
    per_slot = torch.where(local[:, None], per_slot, 0.0)  # other ranks' slots: never written
    return per_slot.view(num_tokens, top_k, hidden).sum(1)


@dataclass(frozen=True)
class TritonExperts:
    """Experts run by the grouped GEMMs, with their variant (biases in the activations'
    dtype): dense as loaded (contiguous, in that dtype), or quantized and stacked."""

    w13: Experts  # [E, 2 * I, H]
    w2: Experts  # [E, H, I]
    variant: ExpertVariant = field(default_factory=ExpertVariant)

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 expert_start: int = 0) -> torch.Tensor:
        return _fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, expert_start,
                          self.variant)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        weights = [w.tensors if isinstance(w, StackedQuantized) else (w,)
                   for w in (self.w13, self.w2)]
        return weights[0] + weights[1] + self.variant.tensors


def prepare_quantized_experts(w13: Sequence[QuantizedWeight], w2: Sequence[QuantizedWeight],
                              variant: ExpertVariant | None = None
                              ) -> TritonExperts | LinearExperts:
    """Quantized experts (with their biases: `variant`, checked, in the activations' dtype)
    stacked for the grouped GEMMs; where they do not stack (module doc), one expert at a time
    on `quant_linear` (the torch reference where the kernel does not take a weight's groups),
    the activation in torch between."""
    variant = variant or ExpertVariant()
    _, hidden, _ = expert_shapes(w13, w2)
    stacked = StackedQuantized.stack(w13), StackedQuantized.stack(w2)
    if None not in stacked:
        return TritonExperts(*stacked, variant)
    kernels = tuple(QuantLinear(w) if supported(w) else QuantLinearRef(w) for w in (*w13, *w2))
    return LinearExperts(kernels[:len(w13)], kernels[len(w13):], hidden, variant.act_and_mul,
                         variant.w13_bias, variant.w2_bias)
