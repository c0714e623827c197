"""Structured outputs' token mask on the GPU: one fused pass, a token whose bit is 0 -> -inf.

Each program takes BLOCK tokens of one row, reads their bitmask words (xgrammar's layout:
token t is bit t % 32 of word t // 32) and stores -inf only where the bit is 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import FLOAT_DTYPES, check_dtype, check_shape

BLOCK = 1024


@triton.jit
def _token_bitmask_kernel(
    logits_ptr,  # [rows, vocab]
    bitmask_ptr,  # [rows, words] int32
    vocab, words, stride_l,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    word = tl.load(bitmask_ptr + row * words + cols // 32, mask=in_vocab, other=-1)
    banned = ((word >> (cols % 32)) & 1) == 0
    neg_inf = tl.full((BLOCK,), float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_l + cols, neg_inf, mask=in_vocab & banned)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on `logits` [R, V]; `bitmask` int32 [R, >= V / 32] (moved to its device)."""
    check_shape("logits", logits, (None, None))
    check_dtype("logits", logits, FLOAT_DTYPES)
    rows, vocab = logits.shape
    check_shape("bitmask", bitmask, (rows, None))
    if bitmask.dtype != torch.int32 or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask must be int32 [{rows}, >= {-(-vocab // 32)}], got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    if logits.stride(1) != 1:
        raise ValueError("logits must have stride 1 in its last dim; pass .contiguous()")
    bitmask = bitmask.to(logits.device, non_blocking=True).contiguous()
    if rows:
        _token_bitmask_kernel[(rows, triton.cdiv(vocab, BLOCK))](
            logits, bitmask, vocab, bitmask.shape[1], logits.stride(0), BLOCK=BLOCK)
