"""The `cpu` backend: the C kernels of this room where they apply, the references elsewhere."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pdserve.kernels.backend import (
    ExpertsKernel,
    ExpertWeights,
    KernelBackend,
    LinearKernel,
    Weight,
)
from pdserve.kernels.cpu import fused_moe, huge_pages, packed_linear, quant_linear
from pdserve.kernels.cpu.decoder_layers import CpuDecoderLayers
from pdserve.kernels.cpu.latent_attention import paged_latent_decode_attention_cpu
from pdserve.kernels.cpu.lora import lora_expand_cpu, lora_shrink_cpu
from pdserve.kernels.cpu.paged_attention import (
    available,
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
)
from pdserve.kernels.cpu.rms_norm import rms_norm_cpu
from pdserve.kernels.cpu.rotary_embedding import rotary_embedding_cpu
from pdserve.kernels.cpu.silu_and_mul import silu_and_mul_cpu
from pdserve.kernels.cpu.store_kv import store_kv_cpu
from pdserve.kernels.cpu.token_bitmask import apply_token_bitmask_cpu
from pdserve.kernels.quant_weights import QuantizedWeight
from pdserve.kernels.reference.fused_moe import ExpertVariant
from pdserve.kernels.reference.linear import DenseLinear
from pdserve.kernels.reference.swigluoai_and_mul import SWIGLU_ALPHA, SWIGLU_LIMIT


class CpuBackend(KernelBackend):
    """Decode and prefill attention reading K/V in place, MLA's absorbed decode, RMSNorm, RoPE,
    SiLU * up, the K/V store, the structured-output token mask and LoRA's shrink and expand in
    C; bf16 linears packed for `linear_bf16.c` (or oneDNN) in huge pages, quantized ones for
    torch's int4/int8 CPU ops; a bf16 layer's step and a bf16 MoE layer's experts each as one C
    call. int8 caches, the KV transfer's block copies and MLA's latent store, gather and dense
    prefill attention run the references (memcpy-bound or SDPA on a CPU)."""

    name = "cpu"
    store_kv = staticmethod(store_kv_cpu)
    paged_decode_attention = staticmethod(paged_decode_attention_cpu)
    paged_prefill_attention = staticmethod(paged_prefill_attention_cpu)
    paged_latent_decode_attention = staticmethod(paged_latent_decode_attention_cpu)
    rms_norm = staticmethod(rms_norm_cpu)
    rotary_embedding = staticmethod(rotary_embedding_cpu)
    silu_and_mul = staticmethod(silu_and_mul_cpu)
    apply_token_bitmask = staticmethod(apply_token_bitmask_cpu)
    lora_shrink = staticmethod(lora_shrink_cpu)
    lora_expand = staticmethod(lora_expand_cpu)
    decoder_layers = CpuDecoderLayers

    @staticmethod
    def available() -> bool:
        """Whether the C kernels built here (a C compiler; see `kernels.cpu.build`)."""
        return available()

    def refuses(self, device: torch.device) -> str | None:
        if device.type != "cpu" or not available():
            return (f"kernel backend 'cpu' needs a CPU device and a C compiler (CC), got "
                    f"{device}; use backend='torch'")
        return None

    def prepare_linears(self, weights: Iterable[Weight], dtype: torch.dtype
                        ) -> Iterator[LinearKernel]:
        """Quantized weights for torch's int4/int8 ops; bf16 ones packed (`packed_linear`),
        the blocked ones all in one mapping of huge pages, which every decode step streams
        through; anything else (fp32: the exact-parity path) as it is."""
        weights = list(weights)
        memory = huge_pages.Arena(packed_linear.blocked_bytes(w) for w in weights
                                  if not isinstance(w, QuantizedWeight))
        for i, w in enumerate(weights):
            weights[i] = None  # held by `w` alone until its kernel is made
            yield self._prepare(w, dtype, memory)

    def prepare_experts(
        self, w13: ExpertWeights, w2: ExpertWeights, dtype: torch.dtype, *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        activation: str = "silu",
        swiglu_alpha: float = SWIGLU_ALPHA,
        swiglu_limit: float = SWIGLU_LIMIT,
    ) -> ExpertsKernel:
        """Each expert's two linears as `prepare_linears` makes them (`fused_moe`): bf16 ones
        packed for `linear_bf16.c` run as one C call per layer (`fused_moe.c`), the others one
        expert at a time on its sorted tokens; gpt-oss's biases and activation in both."""
        variant = ExpertVariant(w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit)
        return fused_moe.prepare_experts(w13, w2, dtype, self._prepare, variant)

    @staticmethod
    def _prepare(w: Weight, dtype: torch.dtype, memory: huge_pages.Arena) -> LinearKernel:
        if isinstance(w, QuantizedWeight):
            return quant_linear.prepare(w, dtype)
        if packed_linear.can_pack(w):
            return packed_linear.pack(w, memory)
        return DenseLinear(w)
