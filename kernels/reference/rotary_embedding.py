"""Rotary position embedding (rotate-half / NeoX layout, as Llama, Qwen2 and Mistral use).

`x * cos + rotate_half(x) * sin` with cos/sin cast to the model dtype, as Hugging Face computes
it: the kernels round every intermediate where this does, so their fp16/bf16 results are
bit-identical to it, not merely close.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def rotary_embedding_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_positions, head_dim] float32, halves duplicated
    sin_cache: torch.Tensor,  # [max_positions, head_dim] float32
) -> None:
    """Rotate q and k in place."""
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)  # [num_tokens, 1, head_dim]
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    q.copy_(_rotate(q, cos, sin))
    k.copy_(_rotate(k, cos, sin))
