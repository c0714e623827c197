"""Rotary embedding on the CPU, in place (`rotary_embedding.c`), bit-identical to the
reference (`kernels.reference.rotary_embedding`)."""

from __future__ import annotations

import torch

from pdserve.kernels.checks import check_shape
from pdserve.kernels.cpu import build
from pdserve.kernels.reference.rotary_embedding import rotary_embedding_ref

_CPU_SIGNATURE = (build.PTR, build.I64, build.PTR, build.I64, build.PTR, build.PTR,
                  build.PTR, build.I64, build.I64, build.I64, build.I64, build.INT)


def _kernel():
    return build.function("rotary_embedding", "rotary_embedding", _CPU_SIGNATURE)


def rotary_embedding_cpu(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64, each < max_positions (the engine's own)
    cos_cache: torch.Tensor,  # [max_positions, head_dim] float32, halves duplicated
    sin_cache: torch.Tensor,  # [max_positions, head_dim] float32
) -> None:
    """`rotary_embedding_ref` in place, in C (`rotary_embedding.c`); bit-identical to it.
    Other dtypes and layouts go to the reference."""
    kernel = _kernel()
    dtype = str(q.dtype).removeprefix("torch.")
    packed = all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (q, k))
    tables = cos_cache.dtype == sin_cache.dtype == torch.float32 and cos_cache.is_contiguous()
    if (kernel is None or dtype not in build.DTYPE_CODES or k.dtype != q.dtype or not packed
            or not tables or not sin_cache.is_contiguous()):
        return rotary_embedding_ref(q, k, positions, cos_cache, sin_cache)
    num_tokens, num_heads, head_dim = q.shape
    check_shape("k", k, (num_tokens, None, head_dim))
    check_shape("positions", positions, (num_tokens,))
    check_shape("cos_cache", cos_cache, (None, head_dim))
    positions = positions.to(torch.int64).contiguous()
    kernel(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), positions.data_ptr(),
           cos_cache.data_ptr(), sin_cache.data_ptr(), num_tokens, num_heads, k.shape[1],
           head_dim, build.DTYPE_CODES[dtype])
