"""gpt-oss's gated activation (vLLM's "swigluoai") for an expert's fused [gate | up] output:

    g = min(gate, limit),  u = clamp(up, -limit, limit),  out = (u + 1) * g * sigmoid(alpha * g)

transformers' `GptOssExperts._apply_gate`, on gate and up de-interleaved at load (the
checkpoint's gate_up_proj interleaves them column by column). Computed in fp32 and rounded to
x's dtype once, as the C and Triton kernels do (transformers rounds each op in bf16)."""

from __future__ import annotations

import torch

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's config values (swiglu_limit, the alpha)


def swigluoai_and_mul_ref(x: torch.Tensor, alpha: float = SWIGLU_ALPHA,
                          limit: float = SWIGLU_LIMIT) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = x.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return ((up + 1) * glu).to(x.dtype)
