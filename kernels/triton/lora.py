"""Batched multi-LoRA on the GPU: shrink and expand as segmented GEMMs (Punica's SGMV).

The step's tokens come in segments, runs of one adapter slot (`kernels.lora_mapping`). Both
kernels launch over (segment, BLOCK_M-row block of the segment, column block); a program reads
its segment's slot and bounds, returns at once where the slot is -1 or the block lies past the
segment's end (the grid is sized for the longest segment), and `tl.dot`s its rows (masked)
against that slot's weights:

1. shrink: buf[rows, cols] = x[rows] a[slot, cols]^T over `in` in BLOCK_K steps, fp32 sums;
   buf starts zeroed, so tokens of slot -1 stay 0;
2. expand: the column blocks are per slice (a block never straddles two: slice s's columns
   start at its offset), y[rows, cols] += buf[rows, s r:(s + 1) r] b[slot, cols]^T, added to y
   in fp32 and rounded once.

Operands are upcast to fp32 after each load. Shrink's dot then runs in x's half type on a GPU
(bf16 x and a: exact products, fp32 sums); expand's in fp32 (buf is fp32): IEEE for fp32 y,
tf32x3 for a half y. Plain tf32 is not enough even there: its error scales with the terms, not
the sum, so where the terms cancel it exceeds y's one rounding (on an H200, 15 of 1140 bf16
outputs were off by up to 14 %). The interpreter is fp32 throughout (`launch.dot_dtype`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import FLOAT_DTYPES, check_device, check_dtype, check_shape
from pdserve.kernels.lora_mapping import LoRAMapping
from pdserve.kernels.triton.launch import dot_dtype, dot_precision, interpreting, pow2

MAX_BLOCK = 64


@triton.jit
def _lora_shrink_kernel(
    buf_ptr,  # [T, R] fp32, zeroed
    x_ptr,  # [T, dim]
    a_ptr,  # [slots, R, dim]
    segment_starts_ptr,  # [S + 1] int32
    segment_slots_ptr,  # [S] int32, -1: skipped
    dim, width,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    segment = tl.program_id(0)
    slot = tl.load(segment_slots_ptr + segment)
    row0 = tl.load(segment_starts_ptr + segment) + tl.program_id(1) * BLOCK_M
    end = tl.load(segment_starts_ptr + segment + 1)
    if (slot < 0) | (row0 >= end):
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < end
    col_mask = cols < width
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * dim
    a_cols = a_ptr + (slot.to(tl.int64) * width + cols.to(tl.int64))[None, :] * dim
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < dim
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.dot(x.to(tl.float32).to(DOT), a.to(tl.float32).to(DOT),
                      input_precision=PRECISION)
    dst = buf_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :]
    tl.store(dst, acc, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [T, out]
    buf_ptr,  # [T, slices * rank] fp32
    b_ptr,  # [slots, out, rank]
    slice_offsets_ptr,  # [slices + 1] int32: 0 = o_0 < ... < o_slices = out
    segment_starts_ptr,  # [S + 1] int32
    segment_slots_ptr,  # [S] int32, -1: skipped
    out, rank, width, col_blocks,  # col_blocks: column blocks per slice
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    segment = tl.program_id(0)
    slot = tl.load(segment_slots_ptr + segment)
    row0 = tl.load(segment_starts_ptr + segment) + tl.program_id(1) * BLOCK_M
    end = tl.load(segment_starts_ptr + segment + 1)
    if (slot < 0) | (row0 >= end):
        return
    s = tl.program_id(2) // col_blocks
    hi = tl.load(slice_offsets_ptr + s + 1)
    cols = (tl.load(slice_offsets_ptr + s) + (tl.program_id(2) % col_blocks) * BLOCK_N
            + tl.arange(0, BLOCK_N))
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    col_mask = cols < hi
    h_rows = buf_ptr + rows.to(tl.int64)[:, None] * width + s * rank
    b_cols = b_ptr + (slot.to(tl.int64) * out + cols.to(tl.int64))[None, :] * rank
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < rank
        h = tl.load(h_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.dot(h, b.to(tl.float32), input_precision=PRECISION)
    dst = y_ptr + rows.to(tl.int64)[:, None] * out + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    y = tl.load(dst, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _check(name: str, t: torch.Tensor, w_name: str, w: torch.Tensor,
           mapping: LoRAMapping) -> None:
    """t [T, *] and its weights w [slots, *, *] alike (dtype, contiguous), the mapping's
    int32 segments on t's device, its slots within w's."""
    check_shape(name, t, (mapping.token_slots.shape[0], None))
    check_dtype(name, t, FLOAT_DTYPES)
    check_shape(w_name, w, (None, None, None))
    if w.dtype != t.dtype:
        raise ValueError(f"{w_name} must have {name}'s dtype {t.dtype}, got {w.dtype}")
    if not t.is_contiguous() or not w.is_contiguous():
        raise ValueError(f"{name} and {w_name} must be contiguous; pass .contiguous()")
    starts, slots = mapping.segment_starts, mapping.segment_slots
    check_device(t.device, **{w_name: w}, segment_starts=starts, segment_slots=slots)
    if starts.dtype != torch.int32 or slots.dtype != torch.int32:
        raise ValueError("the mapping's segments must be int32 (lora_mapping makes them so)")
    if mapping.slots and mapping.slots[-1] >= w.shape[0]:
        raise ValueError(f"slot {mapping.slots[-1]} out of {w_name}'s {w.shape[0]} slots")


def _block_m(mapping: LoRAMapping) -> int:
    """16-row blocks for decodes (short segments), 64 for a prefill chunk's long one."""
    return 16 if mapping.max_segment_len <= 16 else MAX_BLOCK


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, R, in], x.dtype
    mapping: LoRAMapping,
) -> torch.Tensor:  # [T, R] fp32; rows of slot -1 zero
    """`lora_shrink_ref` as one segmented GEMM (module doc)."""
    _check("x", x, "a", a, mapping)
    (num_tokens, dim), width = x.shape, a.shape[1]
    check_shape("a", a, (None, width, dim))
    buf = torch.zeros(num_tokens, width, dtype=torch.float32, device=x.device)
    block_m = _block_m(mapping)
    block_n, block_k = min(pow2(width, 16), MAX_BLOCK), min(pow2(dim, 16), MAX_BLOCK)
    dot = dot_dtype(x.dtype, x.dtype)
    grid = (mapping.segment_slots.shape[0], triton.cdiv(mapping.max_segment_len, block_m),
            triton.cdiv(width, block_n))
    _lora_shrink_kernel[grid](
        buf, x, a, mapping.segment_starts, mapping.segment_slots, dim, width,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot,
        PRECISION=dot_precision(dot))
    return buf


@functools.cache
def _offsets(slice_offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The slice offsets on the device, copied there once per layout."""
    return torch.tensor(slice_offsets, dtype=torch.int32, device=device)


def lora_expand(
    y: torch.Tensor,  # [T, out]
    buf: torch.Tensor,  # [T, R] fp32
    b: torch.Tensor,  # [slots, out, rank], y.dtype
    mapping: LoRAMapping,
    slice_offsets: tuple[int, ...],  # 0 = o_0 < ... < o_slices = out
) -> None:
    """`lora_expand_ref` as one segmented GEMM, in place on y (module doc)."""
    _check("y", y, "b", b, mapping)
    (num_tokens, out), rank = y.shape, b.shape[2]
    slice_offsets = tuple(slice_offsets)
    widths = [hi - lo for lo, hi in zip(slice_offsets, slice_offsets[1:])]
    if slice_offsets[0] != 0 or slice_offsets[-1] != out or min(widths, default=0) <= 0:
        raise ValueError(f"slice offsets must rise from 0 to {out}, got {slice_offsets}")
    check_shape("b", b, (None, out, rank))
    check_shape("buf", buf, (num_tokens, len(widths) * rank))
    if buf.dtype != torch.float32 or not buf.is_contiguous() or buf.device != y.device:
        raise ValueError("buf must be contiguous fp32 on y's device (lora_shrink's result)")
    block_m = _block_m(mapping)
    block_n, block_k = min(pow2(max(widths), 16), MAX_BLOCK), min(pow2(rank, 16), MAX_BLOCK)
    col_blocks = triton.cdiv(max(widths), block_n)
    grid = (mapping.segment_slots.shape[0], triton.cdiv(mapping.max_segment_len, block_m),
            len(widths) * col_blocks)
    _lora_expand_kernel[grid](
        y, buf, b, _offsets(slice_offsets, y.device), mapping.segment_starts,
        mapping.segment_slots, out, rank, buf.shape[1], col_blocks,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if y.dtype == torch.float32 or interpreting() else "tf32x3")
