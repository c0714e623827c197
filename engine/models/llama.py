"""The Llama-family network on paged attention: Llama, Mistral, Qwen2, Qwen3, Phi-3, and the
Mixture-of-Experts members Mixtral and Qwen3-MoE.

Our own modules, not Hugging Face's: fused QKV and gate/up projections (TP-sharded at load),
GQA, RoPE, RMSNorm with fused residual add, SwiGLU, tied embeddings. What the members add is
config-driven: QKV bias (Qwen2), per-head q/k RMSNorm before RoPE (Qwen3), sliding windows
(Mistral, Phi-3, Qwen2/3 `layer_types`), top-k routed experts in place of the MLP (Mixtral,
Qwen3-MoE: `engine.models.moe`). Phi-3's fused checkpoint tensors are split at load
(`engine.loader`). Tokens of all sequences in a step are one flat batch: [num_tokens, hidden].
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.attention import Attention
from pdserve.engine.config import ModelConfig, is_moe_layer
from pdserve.engine.models.moe import SparseMoe
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
from pdserve.kernels.lora_mapping import LoRAMapping


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


# architectures whose attention RMS-normalizes each head of q and k before RoPE
QK_NORM = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})


class LlamaAttention(torch.nn.Module):
    """`norm` makes the per-head q/k norms (None: none); `window` is this layer's sliding
    window, `scale` and `soft_cap` what the attention scores are multiplied and capped by;
    `sinks`: a learned logit per head in every softmax (gpt-oss)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
                 rope: tuple[torch.Tensor, torch.Tensor], window: int | None = None,
                 norm: Callable[[], torch.nn.Module] | None = None, scale: float | None = None,
                 soft_cap: float | None = None, sinks: bool = False, **kw):
        super().__init__()
        d = cfg.head_dim
        self.num_heads = tp.split(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.split(cfg.num_kv_heads, "num_key_value_heads")
        shards = {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d}
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, shards, cfg.attention_bias, tp, **kw)
        # HF's attention_bias biases o_proj too (Llama, gpt-oss); Qwen2's q/k/v biases do not
        o_bias = bool(getattr(cfg.hf_config, "attention_bias", False))
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, tp, bias=o_bias, **kw)
        self.q_norm = norm() if norm else None
        self.k_norm = norm() if norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, ops, scale, window, soft_cap,
                              sinks_from=tp.rank * self.num_heads if sinks else None,
                              device=kw.get("device"))
        self.head_dim = d
        self.rope = rope  # the model's cos, sin tables, shared by every layer (of a kind)
        self.ops = ops

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        kv_cache: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden, meta.lora)  # [T, (H + 2 Hkv) * D]
        d = self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q = q.reshape(-1, self.num_heads, d)  # [T, H, D]
        k = k.reshape(-1, self.num_kv_heads, d)  # [T, Hkv, D]
        v = v.reshape(-1, self.num_kv_heads, d)
        if self.q_norm is not None:  # over each head's d values
            q = self.q_norm(q.reshape(-1, d))[0].reshape(-1, self.num_heads, d)
            k = self.k_norm(k.reshape(-1, d))[0].reshape(-1, self.num_kv_heads, d)
        self.ops.rotary_embedding(q, k, positions, *self.rope)
        out = self.attn(q, k, v, kv_cache, meta)  # [T, H, D]
        return self.o_proj(out.reshape(-1, self.num_heads * d), meta.lora)


class LlamaMLP(torch.nn.Module):
    """down(act(gate) * up): SwiGLU, or Gemma's GeGLU with `act=ops.gelu_tanh_and_mul`;
    `intermediate_size` where it is not the config's (DeepSeek's shared experts)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
                 act: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 intermediate_size: int | None = None, **kw):
        super().__init__()
        self.act = act or ops.silu_and_mul
        inter = intermediate_size or cfg.intermediate_size
        shards = {"gate": inter, "up": inter}
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, shards, False, tp, **kw)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, tp, **kw)

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x, lora)), lora)


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
                 rope: tuple[torch.Tensor, torch.Tensor], index: int, **kw):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, ops, **kw)
        norm = (lambda: RMSNorm(cfg.head_dim, eps, ops, **kw)) if cfg.architecture in QK_NORM \
            else None
        self.self_attn = LlamaAttention(cfg, tp, ops, rope, cfg.window(index), norm, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, ops, **kw)
        moe = is_moe_layer(cfg, index)
        self.mlp = SparseMoe(cfg, tp, ops, **kw) if moe else LlamaMLP(cfg, tp, ops, **kw)

    def forward(self, hidden, residual, positions, kv_cache, meta):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if isinstance(self.mlp, SparseMoe):  # experts take no adapter
            return self.mlp(hidden), residual
        return self.mlp(hidden, meta.lora), residual

    def block(self) -> DecoderBlock | None:
        """This layer as the standard block a backend may run fused (after prepare_weights),
        Qwen3's q/k norms and a sliding window included; None where it is not that block
        (routed experts, an o_proj bias)."""
        attn, mlp = self.self_attn, self.mlp
        if isinstance(mlp, SparseMoe) or attn.o_proj.bias is not None:
            return None
        tp = attn.o_proj.tp
        return DecoderBlock(
            self.input_layernorm.weight, attn.qkv_proj.kernel, attn.qkv_proj.bias,
            attn.o_proj.kernel, self.post_attention_layernorm.weight, mlp.gate_up_proj.kernel,
            mlp.down_proj.kernel, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            self.input_layernorm.eps, attn.rope, tp.all_reduce if tp.size > 1 else None,
            q_norm=attn.q_norm.weight if attn.q_norm is not None else None,
            k_norm=attn.k_norm.weight if attn.k_norm is not None else None,
            window=attn.attn.window,
            loras=None if attn.qkv_proj.lora is None else tuple(
                linear.lora.weights for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                   mlp.down_proj)),
        )


class ModuleDecoderLayer(torch.nn.Module):
    """A pre-norm layer that runs as modules on every backend (not the fused block): input
    norm, `self_attn`, post-attention norm, `mlp` (routed experts: no adapter). A subclass
    builds the four (DeepSeek's, gpt-oss's)."""

    def forward(self, hidden, residual, positions, kv_cache, meta):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def block(self) -> None:
        return None


class LlamaForCausalLM(torch.nn.Module):
    """Every architecture of the module doc (one graph, config-driven). A family that differs
    in its layers, its norm or its embedding subclasses it (`engine.models.gemma`)."""

    norm_class = RMSNorm

    def __init__(
        self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
        dtype: torch.dtype, device: torch.device,
    ):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, **kw)
        self.layers = ops.decoder_layers(self.decoder_layers(cfg, tp, ops, kw))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, ops, **kw)
        self.lm_head = (
            self.embed_tokens
            if cfg.tie_word_embeddings
            else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, **kw)
        )

    def decoder_layers(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
                       kw: dict) -> list[torch.nn.Module]:
        """The layers, all sharing one cos/sin table."""
        rope = rope_tables(cfg.rope_parameters, cfg.head_dim, cfg.max_position_embeddings,
                           cfg.max_model_len, kw["device"])
        return [LlamaDecoderLayer(cfg, tp, ops, rope, i, **kw) for i in range(cfg.num_layers)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """`layer_hook(i)` runs once layer i's K/V are in the cache (KV push overlaps compute)."""
        hidden = self.embed(input_ids)
        hidden, residual = self.layers(hidden, positions, kv_caches, meta, layer_hook)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        return self.lm_head.logits(hidden)
