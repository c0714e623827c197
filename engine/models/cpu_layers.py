"""The decoder layers on the CPU backend: each layer of a step in one C call.

The module path calls a dozen kernels per layer from Python (norm, QKV, RoPE, store,
attention, O, norm, gate/up, SiLU * up, down), and each call's wrapper costs 5-16 us: at a
decode step's few rows, about as much as the work. `kernels.decoder_layer_cpu` runs the same
kernels back to back from C, so the output is bit-identical to the module path; this class
binds the model's layers to it once at load and turns each step's `AttentionMetadata` into
the per-token form its attention takes (one decode query per token, decodes and prefill
chunks alike). Under tensor parallelism each layer runs as two calls, the hidden state
all-reduced after each (the O and down projections give partial sums), as the modules do.

Built only where every layer fits (bf16 weights in `linear_bf16_cpu.c`'s packed layout, none
quantized, RoPE over the whole head); a step takes it only with plain bf16 caches (an int8
cache keeps the module path). Elsewhere, and on the GPU, the modules serve as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.models.parallel import TensorParallel
from pdserve.kernels import decoder_layer_cpu
from pdserve.kernels.decoder_layer_cpu import ATTENTION, MLP, DecoderStep, PreparedLayer


class CpuDecoderLayers:
    def __init__(self, layers: list[PreparedLayer], rope: tuple[torch.Tensor, torch.Tensor],
                 tp: TensorParallel):
        self.layers = layers
        self.rope = rope
        self.tp = tp
        self.parts = (ATTENTION | MLP,) if tp.size == 1 else (ATTENTION, MLP)

    @classmethod
    def build(cls, layers: Sequence, rope: tuple[torch.Tensor, torch.Tensor],
              tp: TensorParallel) -> CpuDecoderLayers | None:
        """`layers`: the model's decoder layers (each with `prepare_cpu()`); None if any of
        them, or the RoPE tables, do not fit the C path."""
        if not decoder_layer_cpu.available() or not layers:
            return None
        prepared = [layer.prepare_cpu() for layer in layers]
        if any(p is None for p in prepared):
            return None
        head_dim = prepared[0].dims[3]
        if not all(t.dtype == torch.float32 and t.is_contiguous() and t.shape[-1] == head_dim
                   for t in rope):
            return None
        return cls(prepared, rope, tp)

    def takes(self, kv_caches: Sequence[tuple[torch.Tensor, ...]]) -> bool:
        """Whether a step over these caches can run here: plain (k, v) bf16 pairs."""
        return all(
            len(cache) == 2 and all(t.dtype == torch.bfloat16 and t.is_contiguous()
                                    for t in cache)
            for cache in kv_caches
        )

    def __call__(
        self,
        hidden: torch.Tensor,  # [T, hidden] bf16: the embedding, updated in place
        positions: torch.Tensor,  # [T] int64
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # hidden, residual: for the final norm
        num_blocks, block_size = kv_caches[0][0].shape[:2]
        step = DecoderStep(self.layers[0], hidden.contiguous(), positions, meta.slot_mapping,
                           token_block_tables(meta), self.rope, block_size,
                           num_blocks * block_size)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            for part in self.parts:
                decoder_layer_cpu.decoder_layer_cpu(layer, step, k_cache, v_cache, part,
                                                    first=i == 0)
                if self.tp.size > 1:
                    self.tp.all_reduce(step.hidden)
            if layer_hook is not None:
                layer_hook(i)
        return step.hidden, step.residual


def token_block_tables(meta: AttentionMetadata) -> torch.Tensor:  # [T, max_blocks] int32
    """Each token's sequence's block table row: decodes first, then every prefill chunk's
    tokens (a query token at position p attends to its sequence's first p + 1 tokens)."""
    parts = []
    if meta.decode is not None:
        parts.append(meta.decode.block_tables)
    if meta.prefill is not None:
        p = meta.prefill
        parts.append(torch.repeat_interleave(p.block_tables, p.query_start_loc.diff().long(),
                                             dim=0))
    if len(parts) == 1:
        return parts[0]
    width = max(t.shape[1] for t in parts)
    return torch.cat([F.pad(t, (0, width - t.shape[1])) for t in parts])
