"""A model's decoder layers run over a step, one module after another: the `decoder_layers` op.

The model builds its layer stack with `ops.decoder_layers(layers)` and calls it once per step;
this is what every backend runs unless it has a faster form (the CPU backend runs each bf16
layer of the standard block as one C call: `kernels.cpu.decoder_layers`). A layer is a module
called as `layer(hidden, residual, positions, kv_cache, meta) -> (hidden, residual)`, with a
`block()` that describes it as a `DecoderBlock` (the shape a backend knows how to fuse) or
returns None; a backend that finds no block (or prepared weights that do not fit it) runs the
layer as a module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.kernels.attention_metadata import AttentionMetadata
from pdserve.kernels.lora_mapping import LoRAWeights


@dataclass(frozen=True)
class DecoderBlock:
    """A pre-norm decoder layer with fused projections (Llama, Qwen2, Qwen3, Mistral): RMSNorm,
    QKV (+ bias), per-head q/k RMSNorms (Qwen3: `q_norm`, `k_norm` over each head's head_dim
    values, with `eps`), RoPE over the whole head (`rope`: cos, sin [max_positions, head_dim]
    fp32), paged attention (a query at position p sees keys p - `window` < j <= p; None: all
    j <= p), O; then RMSNorm, gate|up, SiLU * up, down. The linears are this backend's prepared
    kernels; `all_reduce` sums the partial outputs of O and down across tensor-parallel ranks
    (None without tensor parallelism)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Callable[..., torch.Tensor]  # LinearKernel, [(H + 2 Hkv) * D] outputs
    qkv_bias: torch.Tensor | None  # [(H + 2 Hkv) * D]
    o_proj: Callable[..., torch.Tensor]  # LinearKernel, H * D inputs
    post_norm: torch.Tensor  # [hidden]
    gate_up: Callable[..., torch.Tensor]  # LinearKernel, 2 * intermediate outputs
    down: Callable[..., torch.Tensor]  # LinearKernel, intermediate inputs
    num_heads: int  # this rank's
    num_kv_heads: int
    head_dim: int
    eps: float
    rope: tuple[torch.Tensor, torch.Tensor]
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None  # [head_dim]
    window: int | None = None  # sliding window in tokens; None: the whole context
    # LoRA enabled: the adapters of qkv, o_proj, gate_up, down (added after each linear for
    # the tokens of a step's `meta.lora` that use one, as `KernelBackend.add_lora` does)
    loras: tuple[LoRAWeights, LoRAWeights, LoRAWeights, LoRAWeights] | None = None


class DecoderLayers(torch.nn.ModuleList):
    """The model's decoder layers (a ModuleList: `layers.3.mlp...` names stay as they are)."""

    def prepare(self) -> None:
        """After the layers' weights are in their serving form (`prepare_linears`): bind what a
        backend's faster form needs. Nothing here."""

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the embedding
        positions: torch.Tensor,  # [T] int64
        kv_caches: Sequence[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # hidden, residual: for the final norm
        """`layer_hook(i)` runs once layer i's K/V are in the cache (the KV push overlaps the
        layers still computing); `meta.kv_ready(i)` before layer i (KV tier loads)."""
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self, kv_caches)):
            if meta.kv_ready is not None:
                meta.kv_ready(i)
            hidden, residual = layer(hidden, residual, positions, kv_cache, meta)
            if layer_hook is not None:
                layer_hook(i)
        return hidden, residual
