"""Paged decode attention on the CPU, reading K/V in place (`paged_decode_attention.c`).

Same signature and numerics as `paged_decode_attention_ref` (fp32 scores and softmax), for
fp32 and bf16 caches; the reference stays the oracle and the fallback (`available()` is
False where no C compiler is, and int8 / fp16 caches always use the reference). The
per-layer variants (`sliding_window`, `soft_cap`, gpt-oss's `sinks`) run in C too: the window's
earlier keys are never read.
"""

from __future__ import annotations

import torch

from pdserve.kernels.checks import (
    check_block_tables,
    check_dtype,
    check_kv_cache,
    check_last_contiguous,
)
from pdserve.kernels.cpu import build
from pdserve.kernels.reference.paged_attention import (
    check_attention_variant,
    check_sinks,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C kernel's dtype codes
_I64, _PTR = build.I64, build.PTR
_SIGNATURE = (_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
              _I64, build.INT, build.FLOAT, _I64, build.FLOAT, _PTR)


def _kernel():
    """The C entry with the variants (window 0, soft cap 0 and sinks NULL: off)."""
    return build.function("paged_decode_attention", "paged_decode_attention_sinks",
                          _SIGNATURE, build.INT)


def available() -> bool:
    return _kernel() is not None


def paged_decode_attention_cpu(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. this one
    scale: float,
    max_context_len: int | None = None,
    *,
    sliding_window: int | None = None,  # keys p - W < j <= p only; None: all j <= p
    soft_cap: float | None = None,  # scores c * tanh(s / c); None: uncapped
    sinks: torch.Tensor | None = None,  # fp32 [num_heads]: a logit per head, no value
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the CPU attention kernel is not built: check available() first")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = check_kv_cache(k_cache, v_cache)
    if k_cache.dtype not in DTYPES:
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale,
                                          max_context_len, sliding_window=sliding_window,
                                          soft_cap=soft_cap, sinks=sinks)
    check_attention_variant(sliding_window, soft_cap)
    check_sinks(sinks, num_heads, q.device)
    check_dtype("q", q, (k_cache.dtype,))
    if num_heads % num_kv_heads or cache_dim != head_dim:
        raise ValueError(f"q's shape {tuple(q.shape)} does not match the cache's heads")
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("k_cache and v_cache must be contiguous")
    check_block_tables(block_tables, context_lens, num_seqs)
    check_last_contiguous("q", q)
    if q.stride(1) != head_dim:
        q = q.contiguous()  # heads must be packed; tokens may be strided (a qkv split)
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if num_seqs else 0
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype)
    if num_seqs == 0:
        return out
    rc = kernel(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
        max_context_len, DTYPES[k_cache.dtype], scale, sliding_window or 0, soft_cap or 0.0,
        None if sinks is None else sinks.data_ptr(),
    )
    if rc != 0:
        raise MemoryError("paged_decode_attention_cpu: scratch allocation failed")
    return out


def paged_prefill_attention_cpu(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences concatenated
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. the chunk
    scale: float,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    *,
    sliding_window: int | None = None,  # keys p - W < j <= p only; None: all j <= p
    soft_cap: float | None = None,  # scores c * tanh(s / c); None: uncapped
    sinks: torch.Tensor | None = None,  # fp32 [num_heads]: a logit per head, no value
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if k_cache.dtype not in DTYPES:
        return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc,
                                           context_lens, scale, max_query_len, max_context_len,
                                           sliding_window=sliding_window, soft_cap=soft_cap,
                                           sinks=sinks)
    query_lens = query_start_loc.diff().long()
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)
    # token i of a chunk of n tokens, in a sequence of c cached tokens, sees c - n + i + 1
    # (the last `sliding_window` of them with a window: each query is a decode of its own)
    first_token = query_start_loc[:-1].long()[seq_of_token]
    past = (context_lens.long() - query_lens)[seq_of_token]
    token_context = past + torch.arange(len(seq_of_token)) - first_token + 1
    return paged_decode_attention_cpu(q, k_cache, v_cache, block_tables[seq_of_token],
                                      token_context.to(torch.int32), scale, max_context_len,
                                      sliding_window=sliding_window, soft_cap=soft_cap,
                                      sinks=sinks)
