"""The Llama-family network (Llama, Qwen2, Mistral) on paged attention.

Our own modules, not Hugging Face's: fused QKV and gate/up projections (TP-sharded at load),
GQA, RoPE, RMSNorm with fused residual add, SwiGLU, optional QKV bias (Qwen2), tied
embeddings. Tokens of all sequences in a step are one flat batch: [num_tokens, hidden].
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.attention import Attention
from pdserve.engine.config import ModelConfig
from pdserve.engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)
from pdserve.engine.models.rope import rope_tables
from pdserve.kernels.attention_metadata import AttentionMetadata
from pdserve.kernels.backend import KernelBackend
from pdserve.kernels.decoder_layers import DecoderBlock


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelBackend, **kw):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(size, **kw), False)
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)

    def load(self, name: str, tensor: torch.Tensor, shard: str = "") -> None:
        self.weight.data.copy_(tensor)


class LlamaAttention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
                 rope: tuple[torch.Tensor, torch.Tensor], **kw):
        super().__init__()
        d = cfg.head_dim
        self.num_heads = tp.split(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.split(cfg.num_kv_heads, "num_key_value_heads")
        shards = {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d}
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, shards, cfg.attention_bias, tp, **kw)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, tp, **kw)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, ops)
        self.head_dim = d
        self.rope = rope  # the model's cos, sin tables, shared by every layer
        self.ops = ops

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        kv_cache: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 Hkv) * D]
        d = self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q = q.reshape(-1, self.num_heads, d)  # [T, H, D]
        k = k.reshape(-1, self.num_kv_heads, d)  # [T, Hkv, D]
        v = v.reshape(-1, self.num_kv_heads, d)
        self.ops.rotary_embedding(q, k, positions, *self.rope)
        out = self.attn(q, k, v, kv_cache, meta)  # [T, H, D]
        return self.o_proj(out.reshape(-1, self.num_heads * d))


class LlamaMLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend, **kw):
        super().__init__()
        self.ops = ops
        shards = {"gate": cfg.intermediate_size, "up": cfg.intermediate_size}
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, shards, False, tp, **kw)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
                 rope: tuple[torch.Tensor, torch.Tensor], **kw):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, **kw)
        self.self_attn = LlamaAttention(cfg, tp, ops, rope, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, **kw)
        self.mlp = LlamaMLP(cfg, tp, ops, **kw)

    def forward(self, hidden, residual, positions, kv_cache, meta):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def block(self) -> DecoderBlock:
        """This layer as the standard block a backend may run fused (after prepare_weights)."""
        attn, mlp = self.self_attn, self.mlp
        tp = attn.o_proj.tp
        return DecoderBlock(
            self.input_layernorm.weight, attn.qkv_proj.kernel, attn.qkv_proj.bias,
            attn.o_proj.kernel, self.post_attention_layernorm.weight, mlp.gate_up_proj.kernel,
            mlp.down_proj.kernel, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            self.input_layernorm.eps, attn.rope, tp.all_reduce if tp.size > 1 else None,
        )


class LlamaForCausalLM(torch.nn.Module):
    """Also serves Qwen2ForCausalLM and MistralForCausalLM (same graph, config-driven)."""

    def __init__(
        self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
        dtype: torch.dtype, device: torch.device,
    ):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, **kw)
        self.rope = rope_tables(
            cfg.rope_parameters, cfg.head_dim, cfg.max_position_embeddings,
            cfg.max_model_len, device,
        )
        self.layers = ops.decoder_layers(
            LlamaDecoderLayer(cfg, tp, ops, self.rope, **kw) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, **kw)
        self.lm_head = (
            self.embed_tokens
            if cfg.tie_word_embeddings
            else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, **kw)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """`layer_hook(i)` runs once layer i's K/V are in the cache (KV push overlaps compute)."""
        hidden = self.embed_tokens(input_ids)
        hidden, residual = self.layers(hidden, positions, kv_caches, meta, layer_hook)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        return self.lm_head.logits(hidden)
