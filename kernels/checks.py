"""Argument checks shared by the kernels' wrappers, in every room (plain torch: no Triton).

The wrappers raise `ValueError` naming the offending argument and the fix, so a caller that
passes the wrong layout learns it at the boundary instead of reading garbage from the cache.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCALE_DTYPES = (torch.float16, torch.float32)


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} must have dtype in {allowed}, got {t.dtype}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """`None` in `shape` matches any size."""
    ok = t.dim() == len(shape) and all(
        w is None or w == s for s, w in zip(t.shape, shape, strict=True)
    )
    if not ok:
        want = tuple("*" if w is None else w for w in shape)
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the kernel runs on {device}")


def check_last_contiguous(name: str, t: torch.Tensor) -> None:
    """The head_dim axis must have stride 1 so each row is one vectorised load."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dim; pass {name}.contiguous()")


def check_kv_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, quantized: bool = False
) -> tuple[int, int, int, int]:
    """Validate a K/V cache pair; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    allowed = (torch.int8,) if quantized else FLOAT_DTYPES
    check_dtype("k_cache", k_cache, allowed)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} differs from k_cache {k_cache.dtype}")
    check_last_contiguous("k_cache", k_cache)
    check_last_contiguous("v_cache", v_cache)
    return tuple(k_cache.shape)  # type: ignore[return-value]


def check_kv_scales(
    k_scale: torch.Tensor, v_scale: torch.Tensor, k_cache: torch.Tensor
) -> None:
    """Scales are [num_blocks, block_size, num_kv_heads] beside an int8 cache."""
    check_shape("k_scale", k_scale, tuple(k_cache.shape[:3]))
    check_shape("v_scale", v_scale, tuple(k_cache.shape[:3]))
    check_dtype("k_scale", k_scale, SCALE_DTYPES)
    check_dtype("v_scale", v_scale, SCALE_DTYPES)
    if k_scale.stride() != v_scale.stride():
        raise ValueError("k_scale and v_scale must share strides (allocate them alike)")


def check_latent_cache(cache: torch.Tensor) -> int:
    """A latent (MLA) cache [num_blocks, block_size, entry_dim]; returns entry_dim."""
    if cache.dim() != 3:
        raise ValueError("the latent cache must be [num_blocks, block_size, entry_dim], got "
                         f"shape {tuple(cache.shape)}")
    check_dtype("cache", cache, FLOAT_DTYPES)
    check_last_contiguous("cache", cache)
    return cache.shape[2]


def check_latent_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, kv_lora_rank: int) -> None:
    """The arguments of an absorbed latent decode (`kernels.reference.latent_attention`)."""
    entry_dim = check_latent_cache(cache)
    check_shape("q", q, (None, None, entry_dim))
    check_dtype("q", q, FLOAT_DTYPES)
    check_last_contiguous("q", q)
    if not 0 < kv_lora_rank <= entry_dim:
        raise ValueError(f"kv_lora_rank must be in [1, entry_dim={entry_dim}], got "
                         f"{kv_lora_rank}")
    check_block_tables(block_tables, context_lens, q.shape[0])
    check_device(q.device, cache=cache, block_tables=block_tables, context_lens=context_lens)


def check_block_tables(
    block_tables: torch.Tensor, context_lens: torch.Tensor, num_seqs: int
) -> None:
    check_shape("block_tables", block_tables, (num_seqs, None))
    check_dtype("block_tables", block_tables, (torch.int32, torch.int64))
    check_shape("context_lens", context_lens, (num_seqs,))
    check_dtype("context_lens", context_lens, (torch.int32, torch.int64))
    check_last_contiguous("block_tables", block_tables)
