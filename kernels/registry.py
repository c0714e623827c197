"""Pick the kernel backend for a device: `triton` on CUDA, `torch` elsewhere."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from kernels.paged_decode_attention import paged_decode_attention_ref
from kernels.paged_prefill_attention import paged_prefill_attention_ref
from kernels.rms_norm import rms_norm_ref
from kernels.rotary_embedding import rotary_embedding_ref
from kernels.store_kv import store_kv_ref

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class KernelBackend:
    """The ops the model calls; every backend has the same signatures as the *_ref functions."""

    name: str
    store_kv: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., None]


TORCH_BACKEND = KernelBackend(
    name="torch",
    store_kv=store_kv_ref,
    paged_decode_attention=paged_decode_attention_ref,
    paged_prefill_attention=paged_prefill_attention_ref,
    rms_norm=rms_norm_ref,
    rotary_embedding=rotary_embedding_ref,
)


def get_backend(device: torch.device, name: str | None = None) -> KernelBackend:
    """`name` None picks by device; an explicit name is honoured or refused with the reason."""
    if name is None:
        name = "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    if name == "torch":
        return TORCH_BACKEND
    raise ValueError("kernel backend 'triton' is not available yet; use backend='torch'")
