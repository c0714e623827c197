"""Gemma 2 and Gemma 3 (text) on paged attention, from the Llama family's parts.

What Gemma does differently, config-driven:

- RMSNorm scales by (1 + w): the 1 is added to each norm weight at load;
- four norms per layer: after attention and around the MLP (pre- and post-feedforward), the
  residual added after each post-norm;
- embeddings multiplied by sqrt(hidden_size); GeGLU (tanh GELU) MLP;
- attention scores scaled by `query_pre_attn_scalar ** -0.5` and, in Gemma 2, soft-capped
  (`attn_logit_softcapping`), as are the final logits (`final_logit_softcapping`);
- sliding-window layers by `layer_types` (Gemma 2 alternates; Gemma 3 runs five local layers
  per global one, each kind with its own RoPE base), and Gemma 3's per-head q/k norms.
"""

from __future__ import annotations

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.models.rope import rope_tables
from pdserve.kernels.backend import KernelBackend


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w): the checkpoint's w, loaded as 1 + w."""

    def load(self, name: str, tensor: torch.Tensor, shard: str = "") -> None:
        self.weight.data.copy_(tensor.float() + 1.0)


class GemmaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
                 rope: tuple[torch.Tensor, torch.Tensor], index: int, **kw):
        super().__init__()
        hf, eps, hidden = cfg.hf_config, cfg.rms_norm_eps, cfg.hidden_size
        qk_norm = cfg.architecture == "Gemma3ForCausalLM"
        self.input_layernorm = GemmaRMSNorm(hidden, eps, ops, **kw)
        self.self_attn = LlamaAttention(
            cfg, tp, ops, rope, cfg.window(index),
            norm=(lambda: GemmaRMSNorm(cfg.head_dim, eps, ops, **kw)) if qk_norm else None,
            scale=hf.query_pre_attn_scalar**-0.5,
            soft_cap=getattr(hf, "attn_logit_softcapping", None), **kw)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, ops, **kw)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, ops, **kw)
        self.mlp = LlamaMLP(cfg, tp, ops, ops.gelu_tanh_and_mul, **kw)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, ops, **kw)

    def forward(self, hidden, residual, positions, kv_cache, meta):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, kv_cache, meta)
        hidden = self.post_attention_layernorm(hidden)[0]
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.mlp(hidden, meta.lora)
        return self.post_feedforward_layernorm(hidden)[0], residual

    def block(self) -> None:
        return None  # not the standard block: the backend runs it as a module


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (one graph, config-driven: see the module doc)."""

    norm_class = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
                 dtype: torch.dtype, device: torch.device):
        if getattr(cfg.hf_config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention: an embedding model, not served here")
        super().__init__(cfg, tp, ops, dtype, device)
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5).to(dtype)
        self.final_soft_cap = getattr(cfg.hf_config, "final_logit_softcapping", None)

    def decoder_layers(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
                       kw: dict) -> list[torch.nn.Module]:
        """One cos/sin table per RoPE parameter set (Gemma 3: the local and the global one)."""
        tables = {}
        kinds = getattr(cfg.hf_config, "layer_types", None) or ["full_attention"] * cfg.num_layers
        layers = []
        for i, kind in enumerate(kinds):
            params = cfg.rope_parameters.get(kind, cfg.rope_parameters)
            key = repr(sorted(params.items()))
            if key not in tables:
                tables[key] = rope_tables(params, cfg.head_dim, cfg.max_position_embeddings,
                                          cfg.max_model_len, kw["device"])
            layers.append(GemmaDecoderLayer(cfg, tp, ops, tables[key], i, **kw))
        return layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        logits = self.lm_head.logits(hidden)
        if self.final_soft_cap:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits
