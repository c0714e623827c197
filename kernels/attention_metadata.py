"""What a step's attention needs to know of its tokens: the argument of the backend's attention.

One AttentionMetadata describes a whole mixed step: the first `num_decode_tokens` tokens
belong to single-token (decode-shaped) sequences, the rest to prefill chunks. The model runner
builds it once per step; every layer's attention reads it, and the linears its LoRA mapping
(no per-step module state).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.kernels.lora_mapping import LoRAMapping


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
    lora: LoRAMapping | None = None  # which adapter each token uses; None: the base alone
    # Called with i before layer i reads its KV: blocks loaded from the KV tiers this step land
    # layer by layer beside it (engine.kv_layer_loads); None: nothing to wait for
    kv_ready: Callable[[int], None] | None = None
