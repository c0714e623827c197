"""Attention over the paged KV cache: a layer's heads and scale, run by the kernel backend.

The step's tokens are described by `kernels.attention_metadata.AttentionMetadata`; the backend
stores their K/V and attends (`KernelBackend.attention`), whatever the cache's dtype.
"""

from __future__ import annotations

import torch

from pdserve.kernels.attention_metadata import AttentionMetadata
from pdserve.kernels.backend import KernelBackend


class Attention(torch.nn.Module):
    """Stores the step's K/V into the cache, then attends: decodes and prefills apart.

    `scale` multiplies q.k (default head_dim ** -0.5); `window` limits each query to the last
    `window` positions (a sliding-window layer); `soft_cap` caps the scaled scores as
    soft_cap * tanh(score / soft_cap) (Gemma 2); `sinks_from` (this rank's first head) gives the
    layer one learned logit per head that joins every softmax's denominator (gpt-oss's
    attention sinks, loaded as `sinks`)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, ops: KernelBackend,
                 scale: float | None = None, window: int | None = None,
                 soft_cap: float | None = None, sinks_from: int | None = None,
                 device: torch.device | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window
        self.soft_cap = soft_cap
        self.ops = ops
        self.sinks_from = sinks_from
        self.sinks = None if sinks_from is None else torch.nn.Parameter(
            torch.empty(num_heads, dtype=torch.float32, device=device), False)

    def load(self, name: str, tensor: torch.Tensor, shard: str = "") -> None:
        """The checkpoint's sinks of every head: this rank's."""
        self.sinks.data.copy_(tensor.narrow(0, self.sinks_from, self.num_heads))

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, ...],  # (k, v) [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,  # (+ k_scale, v_scale [num_blocks, block_size, Hkv] if int8)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        variant = {} if self.sinks is None else {"sinks": self.sinks}
        return self.ops.attention(q, k, v, kv_cache, meta, self.scale,
                                  sliding_window=self.window, soft_cap=self.soft_cap, **variant)
