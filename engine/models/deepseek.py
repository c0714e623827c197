"""DeepSeek-V3 (and R1, its fine-tune) on a latent KV cache: multi-head latent attention, shared
plus routed experts.

Attention (MLA). The query comes through a low-rank pair (q_a_proj, its RMSNorm, q_b_proj), or
one q_proj where `q_lora_rank` is None; each head's query is `qk_nope_head_dim` values without
position, then `qk_rope_head_dim` with RoPE. Keys and values come from one compressed latent per
token: `kv_a_proj_with_mqa` gives the latent (`kv_lora_rank`, RMS-normed) and one RoPE'd key
shared by every head; that pair is all the cache holds (`kernels.reference.latent_attention`).
`kv_b_proj` up-projects a latent to each head's no-RoPE key and value: a prefill runs it on the
gathered context (the plain path); a decode instead takes the query into the latent space by its
key half (W_UK) and the output out of it by its value half (W_UV), the absorbed path, so nothing
is decompressed per cached token. With tensor parallelism the heads are split and the latent is
computed, cached and read whole on every rank.

DeepSeek lays each RoPE'd vector out in interleaved pairs (`rope_interleave`); transformers
rotates the pairs and writes the result as two halves. Permuting the RoPE rows of q_b_proj (or
q_proj) and kv_a_proj_with_mqa at load to evens-then-odds, then rotating halves, gives the very
same numbers, so the shared rotary op serves it.

Feed-forward: the first `first_k_dense_replace` layers are dense; the others route each token to
`num_experts_per_tok` of `n_routed_experts` by sigmoid scores plus a load-balancing bias
(`e_score_correction_bias`, used for the choice only), the choice limited to the `topk_group`
best of `n_group` groups of experts (a group scored by its two best), the chosen scores
renormalized (`norm_topk_prob`) and scaled by `routed_scaling_factor`; `n_shared_experts` shared
experts (one MLP) see every token. The routing is `grouped_topk`, a pure function.

YaRN RoPE as the checkpoint sets it; the softmax scale grows by the square of YaRN's mscale
for `mscale_all_dim` (as DeepSeek computes it).
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.llama import (
    LlamaForCausalLM,
    LlamaMLP,
    ModuleDecoderLayer,
    RMSNorm,
)
from pdserve.engine.models.moe import Router
from pdserve.engine.models.parallel import (
    ColumnParallelLinear,
    FusedExperts,
    RowParallelLinear,
    TensorParallel,
)
from pdserve.engine.models.rope import rope_tables
from pdserve.kernels.attention_metadata import AttentionMetadata
from pdserve.kernels.backend import KernelBackend
from pdserve.kernels.quant_weights import QuantizedWeight, dequantize

REPLICATED = TensorParallel()  # a linear every rank holds whole (the latent's projections)


def grouped_topk(
    logits: torch.Tensor,  # [T, E] router logits
    bias: torch.Tensor,  # [E] e_score_correction_bias
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] fp32, ids [T, k] int64
    """DeepSeek-V3's routing (the module doc): sigmoid scores; experts chosen by score + bias
    among the `topk_groups` groups whose two best biased scores sum highest; weighted by their
    unbiased scores, renormalized if asked, times `scaling`."""
    scores = logits.float().sigmoid()
    biased = scores + bias.float()
    num_tokens, num_experts = scores.shape
    grouped = biased.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    groups = group_scores.topk(topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
    ids = biased.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class DeepseekRouter(Router):
    """The gate's [E, H] weights and its [E] choice bias, replicated (kept in fp32)."""

    def __init__(self, num_experts: int, hidden_size: int, **kw):
        super().__init__(num_experts, hidden_size, **kw)
        self.e_score_correction_bias = torch.nn.Parameter(torch.zeros(num_experts, **kw), False)

    def load(self, name: str, tensor: torch.Tensor | QuantizedWeight, shard: str = "") -> None:
        if name == "e_score_correction_bias":
            self.e_score_correction_bias.data.copy_(tensor)
        else:
            super().load(name, tensor, shard)


class DeepseekMoe(torch.nn.Module):
    """Routed experts (fused op) plus the shared experts, each summed over the ranks."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend, **kw):
        super().__init__()
        hf = cfg.hf_config
        self.top_k, self.groups, self.topk_groups = (hf.num_experts_per_tok, hf.n_group,
                                                     hf.topk_group)
        self.renormalize, self.scaling = hf.norm_topk_prob, hf.routed_scaling_factor
        if hf.n_routed_experts % hf.n_group:
            raise ValueError(f"n_routed_experts ({hf.n_routed_experts}) must be a multiple of "
                             f"n_group ({hf.n_group})")
        # fp32, as DeepSeek scores experts: cast once here, not every step
        self.gate = DeepseekRouter(hf.n_routed_experts, cfg.hidden_size,
                                   **{**kw, "dtype": torch.float32})
        inter = hf.moe_intermediate_size
        self.experts = FusedExperts(hf.n_routed_experts, cfg.hidden_size, inter, tp, **kw)
        self.shared_experts = LlamaMLP(cfg, tp, ops, intermediate_size=inter * hf.n_shared_experts,
                                       **kw) if hf.n_shared_experts else None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = grouped_topk(F.linear(x.float(), self.gate.weight),
                                    self.gate.e_score_correction_bias, self.top_k, self.groups,
                                    self.topk_groups, self.renormalize, self.scaling)
        out = self.tp.all_reduce(self.experts(x, weights, ids))
        return out if self.shared_experts is None else out + self.shared_experts(x)


class RopeRowsLinear(ColumnParallelLinear):
    """A projection whose output ends, every `period` rows, in `rope_dim` values that get RoPE
    (each query head; the latent's shared key): with `interleaved` (DeepSeek's layout) those
    rows are loaded evens first, then odds (the module doc). Its one shard is named "x"."""

    def __init__(self, in_features: int, rows: int, period: int, rope_dim: int,
                 interleaved: bool, tp: TensorParallel, **kw):
        super().__init__(in_features, {"x": rows}, False, tp, **kw)
        self.order = rope_order(rows, period, rope_dim) if interleaved else None

    def load(self, name: str, tensor: torch.Tensor | QuantizedWeight, shard: str) -> None:
        if self.order is not None:  # a row permutation: a quantized weight is loaded dense
            dense = dequantize(tensor) if isinstance(tensor, QuantizedWeight) else tensor
            tensor = dense.index_select(0, self.order.to(dense.device))
        super().load(name, tensor, "x")


def rope_order(rows: int, period: int, rope_dim: int) -> torch.Tensor:
    """Row order that puts each period's last `rope_dim` rows evens first, then odds."""
    order = torch.arange(rows).view(-1, period)
    pe = order[:, period - rope_dim:]
    order[:, period - rope_dim:] = torch.cat([pe[:, 0::2], pe[:, 1::2]], dim=1)
    return order.flatten()


class UpProjection(ColumnParallelLinear):
    """kv_b_proj: each head's no-RoPE key and value rows from the latent, as a linear for the
    plain path, and kept dense beside it as W_UK [H, nope, rank] and W_UV [H, v, rank] (this
    rank's heads) for the absorbed one."""

    def __init__(self, rank: int, num_heads: int, nope: int, v: int, tp: TensorParallel, **kw):
        super().__init__(rank, {"kv": num_heads * (nope + v)}, False, tp, **kw)
        local = tp.split(num_heads, "num_attention_heads")
        # buffers: derived from `weight` at load, not checkpoint tensors of their own
        self.register_buffer("w_uk", torch.empty(local, nope, rank, **kw), persistent=False)
        self.register_buffer("w_uv", torch.empty(local, v, rank, **kw), persistent=False)
        self.nope = nope

    def load(self, name: str, tensor: torch.Tensor | QuantizedWeight, shard: str) -> None:
        super().load(name, tensor, shard)
        dense = dequantize(tensor) if isinstance(tensor, QuantizedWeight) else tensor
        heads = self.w_uk.shape[0]
        per_head = dense.narrow(0, self.tp.rank * self.out_features, self.out_features)
        per_head = per_head.reshape(heads, -1, dense.shape[-1])
        self.w_uk.copy_(per_head[:, :self.nope])
        self.w_uv.copy_(per_head[:, self.nope:])


class MlaAttention(torch.nn.Module):
    """Multi-head latent attention over the layer's latent cache (the module doc)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
                 rope: tuple[torch.Tensor, torch.Tensor], **kw):
        super().__init__()
        hf = cfg.hf_config
        self.num_heads = tp.split(cfg.num_heads, "num_attention_heads")
        self.nope, self.rope_dim = hf.qk_nope_head_dim, hf.qk_rope_head_dim
        self.v_dim, self.rank = hf.v_head_dim, hf.kv_lora_rank
        qk = self.nope + self.rope_dim
        if cfg.attention_bias:
            raise ValueError("attention_bias: DeepSeek attention with biases is not supported")
        interleaved = bool(getattr(hf, "rope_interleave", True))
        query = (cfg.num_heads * qk, qk, self.rope_dim, interleaved)
        if hf.q_lora_rank is None:
            self.q_proj = RopeRowsLinear(cfg.hidden_size, *query, tp, **kw)
            self.q_a_proj = None
        else:
            self.q_a_proj = ColumnParallelLinear(cfg.hidden_size, {"x": hf.q_lora_rank}, False,
                                                 REPLICATED, **kw)
            self.q_a_layernorm = RMSNorm(hf.q_lora_rank, cfg.rms_norm_eps, ops, **kw)
            self.q_b_proj = RopeRowsLinear(hf.q_lora_rank, *query, tp, **kw)
        entry = self.rank + self.rope_dim
        self.kv_a_proj_with_mqa = RopeRowsLinear(cfg.hidden_size, entry, entry, self.rope_dim,
                                                 interleaved, REPLICATED, **kw)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps, ops, **kw)
        self.kv_b_proj = UpProjection(self.rank, cfg.num_heads, self.nope, self.v_dim, tp, **kw)
        self.o_proj = RowParallelLinear(cfg.num_heads * self.v_dim, cfg.hidden_size, tp, **kw)
        self.scale = qk**-0.5 * mla_mscale(cfg.rope_parameters) ** 2
        self.rope = rope
        self.ops = ops

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        if self.q_a_proj is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))[0])
        q = q.view(-1, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:].contiguous()
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())[0]
        k_pe = k_pe.contiguous().view(-1, 1, self.rope_dim)
        self.ops.rotary_embedding(q_pe, k_pe, positions, *self.rope)
        entry = torch.cat([latent, k_pe.view(-1, self.rope_dim)], dim=-1)
        out = self.ops.latent_attention(q_nope, q_pe, entry, kv_cache, meta, self.scale,
                                        self.kv_b_proj.w_uk, self.kv_b_proj.w_uv, self.expand)
        return self.o_proj(out.reshape(-1, self.num_heads * self.v_dim))

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[S, rank] latents -> each head's no-RoPE keys [S, H, nope] and values [S, H, v]."""
        kv = self.kv_b_proj(latent).view(-1, self.num_heads, self.nope + self.v_dim)
        return kv[..., :self.nope], kv[..., self.nope:]


def mla_mscale(params: dict) -> float:
    """YaRN's attention temperature for `mscale_all_dim`, squared into the softmax scale;
    1 without YaRN scaling."""
    factor, all_dim = params.get("factor", 1.0), params.get("mscale_all_dim") or 0
    if params.get("rope_type", "default") == "default" or not all_dim or factor <= 1:
        return 1.0
    return 0.1 * all_dim * math.log(factor) + 1.0


class DeepseekDecoderLayer(ModuleDecoderLayer):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
                 rope: tuple[torch.Tensor, torch.Tensor], index: int, **kw):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, ops, **kw)
        self.self_attn = MlaAttention(cfg, tp, ops, rope, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, ops, **kw)
        dense = index < cfg.hf_config.first_k_dense_replace
        self.mlp = LlamaMLP(cfg, tp, ops, **kw) if dense else DeepseekMoe(cfg, tp, ops, **kw)


_ATTN = r"model\.layers\.(\d+)\.self_attn\."
_MLP = r"model\.layers\.(\d+)\.mlp\."


class _LayersFrom:
    """Matches the tensors of layers `first` and on: the multi-token-prediction layers a
    DeepSeek-V3 checkpoint ships after its decoder layers (not served)."""

    pattern = re.compile(r"model\.layers\.(\d+)\..*")

    def __init__(self, first: int):
        self.first = first

    def fullmatch(self, name: str) -> re.Match | None:
        match = self.pattern.fullmatch(name)
        return match if match and int(match[1]) >= self.first else None


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """The Llama family's embedding, final norm and head around MLA / MoE layers."""

    def __init__(self, cfg: ModelConfig, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        # checkpoint names -> (module, shard, parameter), before the loader's shared rules
        self.weight_rules = [
            (_LayersFrom(cfg.num_layers), lambda m: None),
            (re.compile(_ATTN + r"(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)"
                        r"\.weight"),
             lambda m: (f"layers.{m[1]}.self_attn.{m[2]}", "kv" if m[2] == "kv_b_proj" else "x",
                        "weight")),
            (re.compile(_ATTN + r"(q_a_layernorm|kv_a_layernorm)\.weight"),
             lambda m: (f"layers.{m[1]}.self_attn.{m[2]}", "", "weight")),
            (re.compile(_MLP + r"gate\.e_score_correction_bias"),
             lambda m: (f"layers.{m[1]}.mlp.gate", "", "e_score_correction_bias")),
            (re.compile(_MLP + r"shared_experts\.(gate|up)_proj\.weight"),
             lambda m: (f"layers.{m[1]}.mlp.shared_experts.gate_up_proj", m[2], "weight")),
            (re.compile(_MLP + r"shared_experts\.down_proj\.weight"),
             lambda m: (f"layers.{m[1]}.mlp.shared_experts.down_proj", "", "weight")),
        ]

    def decoder_layers(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
                       kw: dict) -> list[torch.nn.Module]:
        hf = cfg.hf_config
        rope = rope_tables(cfg.rope_parameters, hf.qk_rope_head_dim, cfg.max_position_embeddings,
                           cfg.max_model_len, kw["device"])
        return [DeepseekDecoderLayer(cfg, tp, ops, rope, i, **kw) for i in range(cfg.num_layers)]
