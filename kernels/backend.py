"""The one kernel dispatch: a backend per device kind owns every op the model calls.

`get_backend(device)` picks, once, when the model runner starts:

    torch   the references alone (`kernels.reference`): the oracle, and any device
    cpu     the C kernels (`kernels.cpu`), picked on a CPU where the C compiler built them
    triton  the Triton kernels (`kernels.triton`), picked on CUDA (and on CPU tensors under
            TRITON_INTERPRET=1, for the kernel tests)

`KernelBackend` is the contract and the `torch` backend at once: every op as its plain-torch
reference. The other backends subclass it and override the ops they have kernels for; an op
they leave alone runs its reference (so a kernel can be added one op at a time). The model
calls `ops.<op>` and never asks what the device, the cache dtype or a weight's layout is:

- weights: `prepare_linears(weights, dtype)` at load turns every linear's loaded weight (dense, or a
  `QuantizedWeight`) into a `LinearKernel` in the backend's layout (packing, huge pages,
  quantized ops), called as `kernel(x, bias)` from then on;
- MoE experts: `prepare_experts(w13, w2, dtype)` at load (gpt-oss's biases and "swigluoai"
  activation as keywords), an `ExpertsKernel` called as `kernel(x, topk_weights, topk_ids,
  expert_start)`: the routed tokens' grouped GEMMs;
- the layer stack: `decoder_layers(layers)` builds it; `prepare()` binds it after loading;
- attention: `attention(q, k, v, kv_cache, meta, scale, sliding_window=, soft_cap=, sinks=)`
  stores a step's K/V and attends (int8 or float cache alike, a layer's window, soft cap and
  gpt-oss's attention sinks); the single ops beside it are what benchmarks and tests call;
- norms, rotary, activations (SwiGLU's, GeGLU's), the KV store and the KV transfer's block
  pack/unpack; structured outputs' token mask on the logits;
- LoRA adapters: `add_lora(y, x, a, b, mapping, slice_offsets)` adds each token's adapter
  (`kernels.lora_mapping`, -1: none) to a linear's output y in place, as the batched shrink
  (`lora_shrink`: x A^T into an fp32 buffer) then expand (`lora_expand`: y += buffer B^T per
  slice of a fused projection), Punica's SGMV;
- latent attention (MLA): `latent_attention(q_nope, q_pe, entry, kv_cache, meta, scale, w_uk, w_uv,
  expand)` stores a step's latent entries and attends, decodes absorbed into the latent space and
  prefills plain (`kernels.reference.latent_attention`), over its single-tensor cache.

A new op is a method here with its reference in `kernels.reference`, overridden where a backend
has a kernel.
Only the chosen room is imported: nothing on the CPU path imports Triton, nothing on the CUDA
path the C kernels' ctypes glue.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch

from pdserve.kernels.attention_metadata import AttentionMetadata
from pdserve.kernels.decoder_layers import DecoderLayers
from pdserve.kernels.lora_mapping import LoRAMapping
from pdserve.kernels.quant_weights import QuantizedWeight
from pdserve.kernels.reference.fused_moe import (
    ExpertsRef,
    ExpertVariant,
    ExpertWeights,
    cast_experts,
    expert_shapes,
)
from pdserve.kernels.reference.gelu_and_mul import gelu_tanh_and_mul_ref
from pdserve.kernels.reference.latent_attention import (
    gather_latent_ref,
    paged_latent_decode_attention_ref,
    prefill_attention_ref,
    store_latent_ref,
)
from pdserve.kernels.reference.linear import DenseLinear, QuantLinearRef
from pdserve.kernels.reference.lora import lora_expand_ref, lora_shrink_ref
from pdserve.kernels.reference.pack_blocks import pack_blocks_ref, unpack_blocks_ref
from pdserve.kernels.reference.paged_attention import (
    paged_decode_attention_int8_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_int8_ref,
    paged_prefill_attention_ref,
)
from pdserve.kernels.reference.rms_norm import rms_norm_ref
from pdserve.kernels.reference.rotary_embedding import rotary_embedding_ref
from pdserve.kernels.reference.silu_and_mul import silu_and_mul_ref
from pdserve.kernels.reference.store_kv import store_kv_int8_ref, store_kv_ref
from pdserve.kernels.reference.swigluoai_and_mul import SWIGLU_ALPHA, SWIGLU_LIMIT
from pdserve.kernels.reference.token_bitmask import apply_token_bitmask_ref

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "cpu", "triton")
Weight = torch.Tensor | QuantizedWeight


class LinearKernel(Protocol):
    """A linear's weight in the layout of the kernel that runs it: y = x W^T (+ bias)."""

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What it holds (for the weights' bytes as served)."""
        ...


class ExpertsKernel(Protocol):
    """A MoE layer's experts in the layout of the kernel that runs them (`fused_moe_ref`'s
    numerics): the weighted sum over each token's top-k experts, ids outside this rank's
    [expert_start, expert_start + E) adding nothing."""

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 expert_start: int = 0) -> torch.Tensor: ...  # [T, H] fp, [T, k] fp32, int64

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What it holds (for the weights' bytes as served)."""
        ...


class KernelBackend:
    """Every op as its plain-torch reference: the `torch` backend (see the module doc).

    The ops take the references' signatures; a backend's own may add keyword-only tuning knobs
    (e.g. `num_splits`) that callers may ignore. The int8 ops take the scale tensors of
    `kernels.kv_quant` right after the caches.
    """

    name = "torch"
    store_kv = staticmethod(store_kv_ref)
    paged_decode_attention = staticmethod(paged_decode_attention_ref)
    paged_prefill_attention = staticmethod(paged_prefill_attention_ref)
    rms_norm = staticmethod(rms_norm_ref)
    rotary_embedding = staticmethod(rotary_embedding_ref)
    silu_and_mul = staticmethod(silu_and_mul_ref)
    apply_token_bitmask = staticmethod(apply_token_bitmask_ref)  # structured outputs' mask
    gelu_tanh_and_mul = staticmethod(gelu_tanh_and_mul_ref)
    # int8 KV cache (kernels.kv_quant): the scale tensors follow the caches.
    store_kv_int8 = staticmethod(store_kv_int8_ref)
    paged_decode_attention_int8 = staticmethod(paged_decode_attention_int8_ref)
    paged_prefill_attention_int8 = staticmethod(paged_prefill_attention_int8_ref)
    # Latent attention (MLA): its one-tensor cache, absorbed decode, dense prefill attention.
    store_latent = staticmethod(store_latent_ref)
    gather_latent = staticmethod(gather_latent_ref)
    paged_latent_decode_attention = staticmethod(paged_latent_decode_attention_ref)
    prefill_attention = staticmethod(prefill_attention_ref)
    # KV transfer: one layer's blocks <-> one contiguous buffer.
    pack_blocks = staticmethod(pack_blocks_ref)
    unpack_blocks = staticmethod(unpack_blocks_ref)
    # LoRA (kernels.lora_mapping): shrink x [T, in] -> fp32 [T, R], expand it into y in place.
    lora_shrink = staticmethod(lora_shrink_ref)
    lora_expand = staticmethod(lora_expand_ref)
    # The model's layer stack (a ModuleList subclass): built by the model, run once per step.
    decoder_layers = DecoderLayers

    def refuses(self, device: torch.device) -> str | None:
        """Why this backend cannot run on `device`, or None (the references run anywhere)."""
        return None

    def prepare_linears(self, weights: Iterable[Weight], dtype: torch.dtype
                        ) -> Iterator[LinearKernel]:
        """Each linear's loaded weight in this backend's form, once at load, for activations
        of `dtype`; a kernel is yielded as soon as it is made, so a caller that drops each
        loaded weight then holds at most one of them beside the kernels at any time."""
        for w in weights:
            yield QuantLinearRef(w) if isinstance(w, QuantizedWeight) else DenseLinear(w)

    def prepare_experts(
        self, w13: ExpertWeights, w2: ExpertWeights, dtype: torch.dtype, *,
        w13_bias: torch.Tensor | None = None,  # [E, 2 * I]: gate, then up (gpt-oss)
        w2_bias: torch.Tensor | None = None,  # [E, H] (gpt-oss)
        activation: str = "silu",  # or "swigluoai" (gpt-oss)
        swiglu_alpha: float = SWIGLU_ALPHA,
        swiglu_limit: float = SWIGLU_LIMIT,
    ) -> ExpertsKernel:
        """A MoE layer's loaded experts in this backend's form, once at load, for activations
        of `dtype`: w13 [E, 2 * I, H] (gate rows, then up rows) and w2 [E, H, I] dense, or each
        a sequence of E `QuantizedWeight`s; gpt-oss's biases and activation with them
        (`ExpertVariant`). Called as `kernel(x, topk_weights, topk_ids, expert_start)` from
        then on (`kernels.reference.fused_moe`)."""
        variant = ExpertVariant(w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit)
        variant = variant.checked(*expert_shapes(w13, w2), dtype)
        return ExpertsRef(cast_experts(w13, dtype), cast_experts(w2, dtype), variant)

    def add_lora(
        self,
        y: torch.Tensor,  # [T, out]: the linear's output, updated in place
        x: torch.Tensor,  # [T, in]: the linear's input
        a: torch.Tensor,  # [slots, R, in], x.dtype: each slice's A stacked along R
        b: torch.Tensor,  # [slots, out, rank], y.dtype: each slice's B stacked along out
        mapping: LoRAMapping,
        slice_offsets: tuple[int, ...],  # 0 = o_0 < ... < o_slices = out; R = slices * rank
    ) -> None:
        """Each token's adapter added to a linear's output: y[t, o_s:o_s+1] += B_s A_s x[t]
        for each slice s (q/k/v: 3, gate/up: 2, a plain linear: 1), in fp32, y rounded once;
        tokens of slot -1 untouched (`kernels.reference.lora`)."""
        self.lora_expand(y, self.lora_shrink(x, a, mapping), b, mapping, slice_offsets)

    def attention(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, ...],  # (k, v) [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,  # (+ k_scale, v_scale [num_blocks, block_size, Hkv] if int8)
        scale: float,
        *,
        sliding_window: int | None = None,  # keys p - W < j <= p only; None: all j <= p
        soft_cap: float | None = None,  # scores c * tanh(s / c); None: uncapped
        sinks: torch.Tensor | None = None,  # fp32 [num_heads]: gpt-oss's per-head sink logits
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store the step's K/V into the cache, then attend: decodes and prefills apart, with
        the layer's window, soft cap and attention sinks."""
        int8 = len(kv_cache) == 4
        store = self.store_kv_int8 if int8 else self.store_kv
        decode = self.paged_decode_attention_int8 if int8 else self.paged_decode_attention
        prefill = self.paged_prefill_attention_int8 if int8 else self.paged_prefill_attention
        variant = {"sliding_window": sliding_window, "soft_cap": soft_cap, "sinks": sinks}
        store(k, v, *kv_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        parts = []
        if meta.decode is not None:
            d = meta.decode
            parts.append(decode(q[:num_decode], *kv_cache, d.block_tables, d.context_lens,
                                scale, d.max_context_len, **variant))
        if meta.prefill is not None:
            p = meta.prefill
            parts.append(prefill(q[num_decode:], *kv_cache, p.block_tables, p.query_start_loc,
                                 p.context_lens, scale, p.max_query_len, p.max_context_len,
                                 **variant))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def latent_attention(
        self,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, nope_dim]
        q_pe: torch.Tensor,  # [num_tokens, num_heads, rope_dim], RoPE applied
        entry: torch.Tensor,  # [num_tokens, kv_lora_rank + rope_dim]: normed latent, RoPE'd key
        kv_cache: tuple[torch.Tensor],  # (cache [num_blocks, block_size, entry_dim],)
        meta: AttentionMetadata,
        scale: float,
        w_uk: torch.Tensor,  # [num_heads, nope_dim, kv_lora_rank]: each head's key up-projection
        w_uv: torch.Tensor,  # [num_heads, v_dim, kv_lora_rank]: each head's value up-projection
        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_dim]
        """Store the step's latent entries, then attend: decodes absorbed (the query into the
        latent space by W_UK, the output out of it by W_UV), prefills plain (the context's
        latents gathered and `expand`ed, [S, rank] -> ([S, H, nope_dim], [S, H, v_dim]), by
        the layer's kv_b_proj)."""
        (cache,) = kv_cache
        rank = w_uk.shape[-1]
        self.store_latent(entry, cache, meta.slot_mapping)
        n = meta.num_decode_tokens
        parts = []
        if meta.decode is not None:
            d = meta.decode
            q = torch.cat([torch.einsum("thn,hnl->thl", q_nope[:n], w_uk), q_pe[:n]], dim=-1)
            latent = self.paged_latent_decode_attention(q, cache, d.block_tables, d.context_lens,
                                                        scale, d.max_context_len, rank)
            parts.append(torch.einsum("thl,hvl->thv", latent, w_uv))
        if meta.prefill is not None:
            p = meta.prefill
            context = self.gather_latent(cache, p.block_tables, p.context_lens)  # [S, entry]
            k_nope, v = expand(context[:, :rank])
            k_pe = context[:, None, rank:].expand(-1, k_nope.shape[1], -1)
            q = torch.cat([q_nope[n:], q_pe[n:]], dim=-1)
            parts.append(self.prefill_attention(q, torch.cat([k_nope, k_pe], dim=-1), v,
                                                p.query_start_loc, p.context_lens, scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


# name -> (module of its room, class); the room is imported only when its backend is asked for
_ROOMS = {"cpu": ("pdserve.kernels.cpu.backend", "CpuBackend"),
          "triton": ("pdserve.kernels.triton.backend", "TritonBackend")}


@functools.cache
def _backend(name: str) -> KernelBackend:
    if name == "torch":
        return KernelBackend()
    module, cls = _ROOMS[name]
    return getattr(importlib.import_module(module), cls)()


def get_backend(device: torch.device | str, name: str | None = None) -> KernelBackend:
    """`name` None picks by device; an explicit name is honoured or refused with the reason.

    `cpu` needs the C kernels built (a C compiler; see `kernels.cpu.build`).

    `triton` needs a CUDA device, or CPU tensors with TRITON_INTERPRET=1 set before the
    kernels were imported (the kernel tests: ~500x slower than torch, never for serving).
    """
    device = torch.device(device)
    if name is None:
        if device.type == "cuda":
            name = "triton"
        else:
            name = "cpu" if device.type == "cpu" and _backend("cpu").available() else "torch"
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    backend = _backend(name)
    why = backend.refuses(device)
    if why is not None:
        raise ValueError(why)
    logger.debug("kernel backend %s on %s", name, device)
    return backend

