"""OpenAI's gpt-oss: Llama-family attention with attention sinks, alternating sliding-window and
full layers, and a mixture of experts with biases and a clamped SwiGLU.

- Attention: q/k/v/o with biases, GQA, YaRN RoPE; every head has a learned sink, a logit that
  joins each softmax's denominator and carries no value (`Attention` with `sinks_from`, the
  backend's `sinks=` variant). `layer_types` alternate sliding-window and full layers.
- Experts: the router's logits (with a bias) choose the top k, whose logits are softmaxed;
  each expert is down((up + 1) * gate * sigmoid(alpha * gate)) with gate clamped above and up
  on both sides at `swiglu_limit` (vLLM's "swigluoai" activation), both projections biased.
  transformers keeps gate_up_proj as [E, H, 2 I] with gate and up columns interleaved; it is
  loaded as the fused op's [E, 2 I, H], gate rows then up rows. Released checkpoints store
  the experts in MXFP4 (`*_blocks`, `*_scales`: `engine.mxfp4`), dequantized at load.

With tensor-parallel experts each rank adds the down bias's share of one rank (rank 0 the
whole bias, the others none) so the all-reduce adds it once; with expert parallelism each
expert's bias goes with the expert.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    ModuleDecoderLayer,
    RMSNorm,
)
from pdserve.engine.models.moe import Router
from pdserve.engine.models.parallel import FusedExperts, TensorParallel
from pdserve.engine.models.rope import rope_tables
from pdserve.engine.mxfp4 import dequantize_mxfp4
from pdserve.kernels.backend import KernelBackend
from pdserve.kernels.quant_weights import QuantizedWeight

_MLP = r"model\.layers\.(\d+)\.mlp\."


class BiasedRouter(Router):
    """The gate's [E, H] weights and [E] bias, replicated."""

    def __init__(self, num_experts: int, hidden_size: int, **kw):
        super().__init__(num_experts, hidden_size, **kw)
        self.bias = torch.nn.Parameter(torch.empty(num_experts, **kw), False)

    def load(self, name: str, tensor: torch.Tensor | QuantizedWeight, shard: str = "") -> None:
        if name == "bias":
            self.bias.data.copy_(tensor)
        else:
            super().load(name, tensor, shard)


class GptOssExperts(FusedExperts):
    """This rank's experts with their biases (the module doc), from transformers' stacked
    tensors or a checkpoint's MXFP4 blocks and scales."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, **kw):
        hf = cfg.hf_config
        super().__init__(hf.num_local_experts, cfg.hidden_size, hf.intermediate_size, tp, **kw)
        e, i = self.local_experts, self.inter
        self.w13_bias = torch.nn.Parameter(torch.empty(e, 2 * i, **kw), False)
        self.w2_bias = torch.nn.Parameter(torch.empty(e, cfg.hidden_size, **kw), False)
        self.activation = {"activation": "swigluoai", "swiglu_alpha": hf.swiglu_alpha,
                           "swiglu_limit": hf.swiglu_limit}
        self._down_bias_share = 1.0 if tp.expert_parallel or tp.rank == 0 else 0.0
        self._mxfp4: dict[str, torch.Tensor] = {}  # blocks or scales until the other comes

    def load(self, name: str, tensor: torch.Tensor | QuantizedWeight, shard: str) -> None:
        """`shard` is "gate_up" / "down" (dense, as transformers holds them), their `_bias`,
        or their `_blocks` / `_scales` (MXFP4)."""
        part, _, kind = shard.partition(".")
        if kind in ("blocks", "scales"):
            self._mxfp4[f"{part}.{kind}"] = tensor
            blocks, scales = self._mxfp4.get(f"{part}.blocks"), self._mxfp4.get(f"{part}.scales")
            if blocks is None or scales is None:
                return
            del self._mxfp4[f"{part}.blocks"], self._mxfp4[f"{part}.scales"]
            self._load_rows(part, dequantize_mxfp4(blocks, scales, torch.float32))
        elif name == "w13_bias":  # [E, 2 I], gate and up interleaved
            mine = tensor[self.expert_start:self.expert_start + self.local_experts]
            rows = slice(self.inter_start, self.inter_start + self.inter)
            self.w13_bias.data.copy_(torch.cat([mine[:, 0::2][:, rows], mine[:, 1::2][:, rows]],
                                               dim=1))
        elif name == "w2_bias":
            mine = tensor[self.expert_start:self.expert_start + self.local_experts]
            self.w2_bias.data.copy_(mine * self._down_bias_share)
        else:  # dense, x @ W: gate_up [E, H, 2 I], down [E, I, H]
            self._load_rows(part, tensor.transpose(1, 2))

    def _load_rows(self, part: str, weight: torch.Tensor) -> None:
        """gate_up as [E, 2 I, H] with gate and up rows interleaved, or down as [E, H, I]."""
        if part == "gate_up":
            weight = torch.cat([weight[:, 0::2], weight[:, 1::2]], dim=1)
        super().load("weight", weight, part)

    def prepare(self, ops: KernelBackend) -> None:
        if self._mxfp4:
            raise ValueError(f"model: MXFP4 experts lack {sorted(self._mxfp4)}'s other half")
        self.variant = {"w13_bias": self.w13_bias.data, "w2_bias": self.w2_bias.data,
                        **self.activation}
        super().prepare(ops)
        self.w13_bias = self.w2_bias = None  # the kernel's now


class GptOssMoe(torch.nn.Module):
    """Top-k of the biased router's logits, softmaxed; the experts; one all-reduce."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, **kw):
        super().__init__()
        hf = cfg.hf_config
        self.top_k = hf.num_experts_per_tok
        self.router = BiasedRouter(hf.num_local_experts, cfg.hidden_size, **kw)
        self.experts = GptOssExperts(cfg, tp, **kw)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        logits = F.linear(x, self.router.weight, self.router.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        # softmaxed in the logits' dtype, as transformers' router does, then fp32 (exact) as
        # the experts' kernels take routing weights: bf16 served gpt-oss failed here before
        weights = torch.softmax(top, dim=-1, dtype=top.dtype).float()
        return self.tp.all_reduce(self.experts(x, weights, ids))


class GptOssDecoderLayer(ModuleDecoderLayer):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
                 rope: tuple[torch.Tensor, torch.Tensor], index: int, **kw):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, ops, **kw)
        self.self_attn = LlamaAttention(cfg, tp, ops, rope, cfg.window(index), sinks=True, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, ops, **kw)
        self.mlp = GptOssMoe(cfg, tp, **kw)


class GptOssForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        # checkpoint names -> (module, shard, parameter), before the loader's shared rules
        self.weight_rules = [
            (re.compile(r"model\.layers\.(\d+)\.self_attn\.sinks"),
             lambda m: (f"layers.{m[1]}.self_attn.attn", "", "sinks")),
            (re.compile(_MLP + r"router\.(weight|bias)"),
             lambda m: (f"layers.{m[1]}.mlp.router", "", m[2])),
            (re.compile(_MLP + r"experts\.(gate_up|down)_proj_bias"),
             lambda m: (f"layers.{m[1]}.mlp.experts", m[2],
                        "w13_bias" if m[2] == "gate_up" else "w2_bias")),
            (re.compile(_MLP + r"experts\.(gate_up|down)_proj(?:_(blocks|scales))?"),
             lambda m: (f"layers.{m[1]}.mlp.experts",
                        f"{m[2]}.{m[3]}" if m[3] else m[2], "w2" if m[2] == "down" else "w13")),
        ]

    def decoder_layers(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend,
                       kw: dict) -> list[torch.nn.Module]:
        rope = rope_tables(cfg.rope_parameters, cfg.head_dim, cfg.max_position_embeddings,
                           cfg.max_model_len, kw["device"])
        return [GptOssDecoderLayer(cfg, tp, ops, rope, i, **kw) for i in range(cfg.num_layers)]
