"""Structured outputs' token mask on the logits: a token whose bit is 0 gets -inf.

xgrammar's layout: row r of an int32 bitmask [R, ceil(V / 32)] holds token t at bit t % 32 of
word t // 32 (least significant bit first), so on a little-endian machine (x86, ARM, CUDA)
byte t // 8 holds tokens 8k .. 8k + 7 from its lowest bit up. All bits set: no constraint.
"""

from __future__ import annotations

import torch


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on `logits` [R, V] (any float dtype); `bitmask` int32 [R, >= V / 32]."""
    rows, vocab = logits.shape
    bits = bitmask.to(logits.device).contiguous().view(torch.uint8)  # [R, 4 * words]
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(rows, -1)[:, :vocab]  # [R, V]
    logits.masked_fill_(allowed == 0, float("-inf"))
