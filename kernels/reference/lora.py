"""Batched multi-LoRA: each token's adapter added to a linear's output (Punica's SGMV/BGMV).

A step's tokens each use the adapter of their slot (`kernels.lora_mapping.LoRAMapping`, -1:
none) out of the stacked adapter weights of one linear, in two ops:

1. shrink: buf[t] = A[slot_t] x[t], [T, R] in fp32 (R = slices * rank, a slot's rows past its
   own rank zero);
2. expand: y[t, o_s:o_s+1] += buf[t, s r:(s + 1) r] B[slot_t, o_s:o_s+1]^T for each slice s,
   in fp32, added to y in place (rounded once to y's dtype).

A fused projection (q/k/v: 3 slices, gate/up: 2) shares one y and one buf: each slice has its
own A (stacked along R) and B (stacked along out, at `slice_offsets`); a plain linear is one
slice, offsets (0, out). Tokens without an adapter: zero in buf, y untouched.

The references loop over the distinct slots of the step (a handful), each on its tokens' rows:
never a per-token copy of the weights.
"""

from __future__ import annotations

import torch

from pdserve.kernels.lora_mapping import LoRAMapping


def lora_shrink_ref(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, R, in], x.dtype
    mapping: LoRAMapping,
) -> torch.Tensor:  # [T, R] fp32; rows of slot -1 zero
    """buf[t] = a[slot_t] @ x[t] in fp32."""
    buf = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot in mapping.slots:
        rows = mapping.token_slots == slot  # [T] bool
        buf[rows] = x[rows].float() @ a[slot].float().T
    return buf


def lora_expand_ref(
    y: torch.Tensor,  # [T, out]
    buf: torch.Tensor,  # [T, R] fp32, R = slices * rank
    b: torch.Tensor,  # [slots, out, rank], y.dtype
    mapping: LoRAMapping,
    slice_offsets: tuple[int, ...],  # 0 = o_0 < o_1 < ... < o_slices = out
) -> None:
    """In place: y[t, o_s:o_s+1] += buf[t, s r:(s + 1) r] @ b[slot_t, o_s:o_s+1]^T, in fp32."""
    rank = b.shape[2]
    for slot in mapping.slots:
        rows = mapping.token_slots == slot  # [T] bool
        w, h = b[slot].float(), buf[rows]  # [out, rank], [n, R]
        delta = torch.cat([h[:, s * rank:(s + 1) * rank] @ w[lo:hi].T
                           for s, (lo, hi) in enumerate(zip(slice_offsets, slice_offsets[1:]))],
                          dim=1)  # [n, out]
        y[rows] = (y[rows].float() + delta).to(y.dtype)
