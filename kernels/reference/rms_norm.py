"""RMSNorm with an optional fused residual add (Hugging Face LlamaRMSNorm numerics).

The residual sum is rounded to the model dtype before it is normed (as the unfused model
does), the variance is fp32, and the normed row is cast back before the weight multiply.
"""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (normed, new_residual); new_residual = x + residual (or x when none)."""
    if residual is not None:
        x = x + residual
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(x.dtype), x
