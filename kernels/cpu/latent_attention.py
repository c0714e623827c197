"""Paged latent (MLA) decode attention on the CPU, reading the latent cache in place
(`latent_attention.c`: 16 query heads per pass over a sequence's entries, 8 without AVX-512).

Same signature and numerics as `paged_latent_decode_attention_ref` (fp32 scores, softmax and
sums), for fp32 and bf16 queries and caches; fp16 ones (or no C compiler: `available()`) run
the reference. `out=` (this room's own knob) writes into a given tensor.

The cache's store and gather and the dense prefill attention stay on the references here:
the gather (index_select) takes ~1.2x a contiguous copy of the same bytes, a decode step's
store is microseconds, and the prefill is torch's SDPA (~30-40 GFLOP/s on one core in bf16,
with the reference's mask as with `is_causal`); `benchmarks/kernels.py` measures them.
"""

from __future__ import annotations

import torch

from pdserve.kernels.checks import check_dtype, check_latent_decode, check_shape
from pdserve.kernels.cpu import build
from pdserve.kernels.reference.latent_attention import paged_latent_decode_attention_ref

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C kernel's dtype codes
_I64, _PTR, _INT = build.I64, build.PTR, build.INT
_SIGNATURE = (_PTR, _I64, _INT, _PTR, _INT, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
              build.FLOAT)


def _kernel():
    return build.function("latent_attention", "paged_latent_decode_attention", _SIGNATURE,
                          build.INT)


def available() -> bool:
    return _kernel() is not None


def paged_latent_decode_attention_cpu(
    q: torch.Tensor,  # [num_seqs, num_heads, entry_dim]: absorbed no-RoPE part, then RoPE part
    cache: torch.Tensor,  # [num_blocks, block_size, entry_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, incl. the new token
    scale: float,
    max_context_len: int,  # unused: the kernel reads the lengths
    kv_lora_rank: int,  # the values are each entry's first kv_lora_rank numbers
    *,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, kv_lora_rank], q's dtype, contiguous
) -> torch.Tensor:  # [num_seqs, num_heads, kv_lora_rank] in q's dtype
    kernel = _kernel()
    if kernel is None or q.dtype not in DTYPES or cache.dtype not in DTYPES:
        ref = paged_latent_decode_attention_ref(q, cache, block_tables, context_lens, scale,
                                                max_context_len, kv_lora_rank)
        return ref if out is None else out.copy_(ref)
    check_latent_decode(q, cache, block_tables, context_lens, kv_lora_rank)
    if not cache.is_contiguous():  # the C kernel indexes blocks and slots by row
        raise ValueError("the latent cache must be contiguous, got strides "
                         f"{cache.stride()}")
    num_seqs, num_heads, entry_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != entry_dim:
        q = q.contiguous()  # heads must be packed; tokens may be strided
    shape = (num_seqs, num_heads, kv_lora_rank)
    if out is None:
        out = torch.empty(shape, dtype=q.dtype)
    check_shape("out", out, shape)
    check_dtype("out", out, (q.dtype,))
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if num_seqs == 0 or num_heads == 0:
        return out
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    rc = kernel(q.data_ptr(), q.stride(0), DTYPES[q.dtype], cache.data_ptr(),
                DTYPES[cache.dtype], block_tables.data_ptr(), block_tables.stride(0),
                context_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, entry_dim,
                kv_lora_rank, cache.shape[1], scale)
    if rc != 0:
        raise MemoryError("paged_latent_decode_attention_cpu: scratch allocation failed")
    return out
