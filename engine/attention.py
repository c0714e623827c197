"""Attention over the paged KV cache, through the kernel backend of the device.

One AttentionMetadata describes a whole mixed step: the first `num_decode_tokens` tokens
belong to single-token (decode-shaped) sequences, the rest to prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.registry import KernelBackend


@dataclass(frozen=True)
class DecodeMetadata:
    block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    context_lens: torch.Tensor  # [num_decodes] int32, incl. the new token
    max_context_len: int


@dataclass(frozen=True)
class PrefillMetadata:
    block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_prefills + 1] int32, offsets into the prefill tokens
    context_lens: torch.Tensor  # [num_prefills] int32, incl. the chunk
    max_query_len: int
    max_context_len: int


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes
    num_decode_tokens: int
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None


class Attention(torch.nn.Module):
    """Stores the step's K/V into the cache, then attends: decodes and prefills apart."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, ops: KernelBackend):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.ops = ops

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, ...],  # (k, v) [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,  # (+ k_scale, v_scale [num_blocks, block_size, Hkv] if int8)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ops = self.ops
        int8 = len(kv_cache) == 4
        store = ops.store_kv_int8 if int8 else ops.store_kv
        decode = ops.paged_decode_attention_int8 if int8 else ops.paged_decode_attention
        prefill = ops.paged_prefill_attention_int8 if int8 else ops.paged_prefill_attention
        store(k, v, *kv_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        parts = []
        if meta.decode is not None:
            d = meta.decode
            parts.append(
                decode(
                    q[:num_decode], *kv_cache, d.block_tables, d.context_lens, self.scale,
                    d.max_context_len,
                )
            )
        if meta.prefill is not None:
            p = meta.prefill
            parts.append(
                prefill(
                    q[num_decode:], *kv_cache, p.block_tables, p.query_start_loc,
                    p.context_lens, self.scale, p.max_query_len, p.max_context_len,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)
