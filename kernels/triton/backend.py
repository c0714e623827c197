"""The `triton` backend: the Triton kernels of this room on CUDA, cuBLAS for dense linears."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from pdserve.kernels.backend import (
    ExpertsKernel,
    ExpertWeights,
    KernelBackend,
    LinearKernel,
    Weight,
)
from pdserve.kernels.quant_weights import QuantizedWeight
from pdserve.kernels.reference.fused_moe import ExpertVariant, cast_experts, expert_shapes
from pdserve.kernels.reference.linear import DenseLinear, QuantLinearRef
from pdserve.kernels.reference.swigluoai_and_mul import SWIGLU_ALPHA, SWIGLU_LIMIT
from pdserve.kernels.triton.fused_moe import TritonExperts, prepare_quantized_experts
from pdserve.kernels.triton.latent_attention import (
    gather_latent,
    paged_latent_decode_attention,
    prefill_attention,
    store_latent,
)
from pdserve.kernels.triton.launch import interpreting
from pdserve.kernels.triton.lora import lora_expand, lora_shrink
from pdserve.kernels.triton.pack_blocks import pack_blocks, unpack_blocks
from pdserve.kernels.triton.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_int8,
)
from pdserve.kernels.triton.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_int8,
)
from pdserve.kernels.triton.quant_linear import QuantLinear, supported
from pdserve.kernels.triton.rms_norm import rms_norm
from pdserve.kernels.triton.rotary_embedding import rotary_embedding
from pdserve.kernels.triton.store_kv import store_kv, store_kv_int8
from pdserve.kernels.triton.token_bitmask import apply_token_bitmask

logger = logging.getLogger(__name__)


class TritonBackend(KernelBackend):
    """Every op a kernel of its own but SiLU * up (torch's fused elementwise kernels on CUDA)
    and dense linears (cuBLAS)."""

    name = "triton"
    store_kv = staticmethod(store_kv)
    paged_decode_attention = staticmethod(paged_decode_attention)
    paged_prefill_attention = staticmethod(paged_prefill_attention)
    rms_norm = staticmethod(rms_norm)
    rotary_embedding = staticmethod(rotary_embedding)
    store_kv_int8 = staticmethod(store_kv_int8)
    paged_decode_attention_int8 = staticmethod(paged_decode_attention_int8)
    paged_prefill_attention_int8 = staticmethod(paged_prefill_attention_int8)
    store_latent = staticmethod(store_latent)
    gather_latent = staticmethod(gather_latent)
    paged_latent_decode_attention = staticmethod(paged_latent_decode_attention)
    prefill_attention = staticmethod(prefill_attention)
    pack_blocks = staticmethod(pack_blocks)
    unpack_blocks = staticmethod(unpack_blocks)
    apply_token_bitmask = staticmethod(apply_token_bitmask)
    lora_shrink = staticmethod(lora_shrink)
    lora_expand = staticmethod(lora_expand)

    def refuses(self, device: torch.device) -> str | None:
        if device.type != "cuda" and not interpreting():
            return (f"kernel backend 'triton' needs a CUDA device, got {device}; use "
                    "backend='torch' (or set TRITON_INTERPRET=1 before importing kernels, for "
                    "tests only)")
        return None

    def prepare_linears(self, weights: Iterable[Weight], dtype: torch.dtype
                        ) -> Iterator[LinearKernel]:
        return (_prepare(w) for w in weights)

    def prepare_experts(
        self, w13: ExpertWeights, w2: ExpertWeights, dtype: torch.dtype, *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        activation: str = "silu",
        swiglu_alpha: float = SWIGLU_ALPHA,
        swiglu_limit: float = SWIGLU_LIMIT,
    ) -> ExpertsKernel:
        """Dense experts for the grouped GEMMs of `fused_moe`; quantized ones one expert at a
        time on the quantized linear kernel; gpt-oss's biases and activation in both."""
        variant = ExpertVariant(w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit)
        variant = variant.checked(*expert_shapes(w13, w2), dtype)
        if isinstance(w13, torch.Tensor):
            return TritonExperts(cast_experts(w13, dtype), cast_experts(w2, dtype), variant)
        return prepare_quantized_experts(w13, w2, variant)


def _prepare(w: Weight) -> LinearKernel:
    if not isinstance(w, QuantizedWeight):
        return DenseLinear(w)
    if supported(w):
        return QuantLinear(w)
    logger.warning("int%d weights with group size %d run on the torch reference (the kernel "
                   "takes multiples of its minimum group)", w.bits, w.group_size)
    return QuantLinearRef(w)
