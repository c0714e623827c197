"""Pick the kernel backend for a device: `triton` on CUDA, `cpu` (else `torch`) elsewhere.

Every backend exposes the same ops with the signatures of the `*_ref` functions; the Triton
wrappers add keyword-only tuning knobs (e.g. `num_splits`) that callers may ignore. The int8
ops take the scale tensors of `kernels.kv_quant` right after the caches. `torch` is the
references alone; `cpu` is the references plus the C kernels of `kernels.native` (decode
attention reading K/V in place, also prefill attention as one decode query per token in
`paged_prefill_attention_cpu`; RMSNorm, RoPE, SiLU * up, the K/V store), picked on a CPU
when the C compiler built them; each falls back to its reference for a dtype or layout it does
not take.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pdserve.kernels import paged_decode_attention_cpu as native_decode
from pdserve.kernels.checks import interpreting
from pdserve.kernels.pack_blocks import (
    pack_blocks,
    pack_blocks_ref,
    unpack_blocks,
    unpack_blocks_ref,
)
from pdserve.kernels.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_int8,
    paged_decode_attention_int8_ref,
    paged_decode_attention_ref,
)
from pdserve.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_int8,
    paged_prefill_attention_int8_ref,
    paged_prefill_attention_ref,
)
from pdserve.kernels.paged_prefill_attention_cpu import paged_prefill_attention_cpu
from pdserve.kernels.rms_norm import rms_norm, rms_norm_cpu, rms_norm_ref
from pdserve.kernels.rotary_embedding import (
    rotary_embedding,
    rotary_embedding_cpu,
    rotary_embedding_ref,
)
from pdserve.kernels.silu_and_mul import silu_and_mul_cpu, silu_and_mul_ref
from pdserve.kernels.store_kv import (
    store_kv,
    store_kv_cpu,
    store_kv_int8,
    store_kv_int8_ref,
    store_kv_ref,
)

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "cpu", "triton")


@dataclass(frozen=True)
class KernelBackend:
    """The ops the model calls; every backend has the same signatures as the *_ref functions."""

    name: str
    store_kv: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., None]
    silu_and_mul: Callable[..., torch.Tensor]
    # int8 KV cache (kernels.kv_quant): the scale tensors follow the caches.
    store_kv_int8: Callable[..., None]
    paged_decode_attention_int8: Callable[..., torch.Tensor]
    paged_prefill_attention_int8: Callable[..., torch.Tensor]
    # KV transfer: one layer's blocks <-> one contiguous buffer (kernels.pack_blocks).
    pack_blocks: Callable[..., torch.Tensor]
    unpack_blocks: Callable[..., None]


TORCH_BACKEND = KernelBackend(
    name="torch",
    store_kv=store_kv_ref,
    paged_decode_attention=paged_decode_attention_ref,
    paged_prefill_attention=paged_prefill_attention_ref,
    rms_norm=rms_norm_ref,
    rotary_embedding=rotary_embedding_ref,
    silu_and_mul=silu_and_mul_ref,
    store_kv_int8=store_kv_int8_ref,
    paged_decode_attention_int8=paged_decode_attention_int8_ref,
    paged_prefill_attention_int8=paged_prefill_attention_int8_ref,
    pack_blocks=pack_blocks_ref,
    unpack_blocks=unpack_blocks_ref,
)


def _native_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """The C kernel for fp32 / bf16 caches; fp16 goes to the reference."""
    native = native_decode.paged_decode_attention_cpu
    fn = native if k_cache.dtype in native_decode.DTYPES else paged_decode_attention_ref
    return fn(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len)


CPU_BACKEND = replace(
    TORCH_BACKEND, name="cpu", paged_decode_attention=_native_paged_decode_attention,
    paged_prefill_attention=paged_prefill_attention_cpu, rms_norm=rms_norm_cpu,
    rotary_embedding=rotary_embedding_cpu, silu_and_mul=silu_and_mul_cpu, store_kv=store_kv_cpu,
)

TRITON_BACKEND = KernelBackend(
    name="triton",
    store_kv=store_kv,
    paged_decode_attention=paged_decode_attention,
    paged_prefill_attention=paged_prefill_attention,
    rms_norm=rms_norm,
    rotary_embedding=rotary_embedding,
    silu_and_mul=silu_and_mul_ref,  # torch's elementwise kernels on CUDA
    store_kv_int8=store_kv_int8,
    paged_decode_attention_int8=paged_decode_attention_int8,
    paged_prefill_attention_int8=paged_prefill_attention_int8,
    pack_blocks=pack_blocks,
    unpack_blocks=unpack_blocks,
)


def get_backend(device: torch.device, name: str | None = None) -> KernelBackend:
    """`name` None picks by device; an explicit name is honoured or refused with the reason.

    `cpu` needs the C kernels built (a C compiler; see `kernels.native`).

    `triton` needs a CUDA device, or CPU tensors with TRITON_INTERPRET=1 set before the
    kernels were imported (the kernel tests: ~500x slower than torch, never for serving).
    """
    device = torch.device(device)
    if name is None:
        name = "triton" if device.type == "cuda" else "cpu"
        if name == "cpu" and not native_decode.available():
            name = "torch"
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    if name == "torch":
        return TORCH_BACKEND
    if name == "cpu":
        if device.type != "cpu" or not native_decode.available():
            raise ValueError(
                f"kernel backend 'cpu' needs a CPU device and a C compiler (CC), got {device}; "
                "use backend='torch'"
            )
        return CPU_BACKEND
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"kernel backend 'triton' needs a CUDA device, got {device}; use backend='torch' "
            "(or set TRITON_INTERPRET=1 before importing kernels, for tests only)"
        )
    logger.debug("kernel backend triton on %s", device)
    return TRITON_BACKEND
