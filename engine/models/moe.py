"""Top-k routed experts in place of the dense MLP (Mixtral, Qwen3-MoE), run by the backend's
fused-MoE op.

The router is replicated on every rank: its logits, softmax in fp32, top-k, and (Mixtral
always, Qwen3-MoE with `norm_topk_prob`) the top-k weights renormalized to sum to 1, as
transformers computes them. The experts' weights are stacked per layer, w13 = [gate | up]
[E, 2 I, H] and w2 = down [E, H, I], and handed to `ops.prepare_experts` after loading.

Across a tensor-parallel group the experts are split one of two ways, and the partial outputs
summed with one all-reduce either way:

- tensor-parallel experts (default): every rank holds a 1/N slice of every expert's
  intermediate size;
- expert parallelism (`TensorParallel.expert_parallel`, vLLM's `--enable-expert-parallel`):
  each rank holds E/N experts whole, and a token's output is the sum over the ranks that hold
  its chosen experts (a rank computes only the slots routed to its own).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.config import ModelConfig, num_experts
from pdserve.engine.models.parallel import FusedExperts, TensorParallel
from pdserve.kernels.backend import KernelBackend
from pdserve.kernels.quant_weights import QuantizedWeight, dequantize


class Router(torch.nn.Module):
    """The replicated gate: [E, H] logits weights."""

    def __init__(self, num_experts: int, hidden_size: int, **kw):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden_size, **kw), False)

    def load(self, name: str, tensor: torch.Tensor | QuantizedWeight, shard: str = "") -> None:
        if isinstance(tensor, QuantizedWeight):
            tensor = dequantize(tensor)
        self.weight.data.copy_(tensor)


class SparseMoe(torch.nn.Module):
    """Router, top-k, experts; the ranks' partial outputs summed (see the module doc)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: KernelBackend, **kw):
        super().__init__()
        hf = cfg.hf_config
        experts = num_experts(hf)
        self.top_k = hf.num_experts_per_tok
        self.renormalize = getattr(hf, "norm_topk_prob", True)  # Mixtral: always
        self.gate = Router(experts, cfg.hidden_size, **kw)
        inter = getattr(hf, "moe_intermediate_size", None) or cfg.intermediate_size
        self.experts = FusedExperts(experts, cfg.hidden_size, inter, tp, **kw)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return self.tp.all_reduce(self.experts(x, weights, ids))
