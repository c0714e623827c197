"""MXFP4 weights (OCP microscaling FP4), as gpt-oss checkpoints store their experts.

A tensor is `*_blocks` uint8 `[..., G, 16]` and `*_scales` uint8 `[..., G]`: each group of 32
values along the last dimension is 16 bytes of 4-bit E2M1 codes (the low nibble first) and one
E8M0 scale, the power of two 2**(scale - 127) that multiplies the group. Dequantized at load:
no backend here has an MXFP4 GEMM, so the experts are served from the dequantized values (what
transformers does on a device without its MXFP4 kernels).
"""

from __future__ import annotations

import torch

# The 16 E2M1 codes: sign bit, two exponent bits, one mantissa bit.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
                     ) -> torch.Tensor:  # [..., G * 32]
    """`blocks` [..., G, 16] uint8 and `scales` [..., G] uint8 as values of `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales "
                         f"{list(scales.shape)}: want [..., G, 16] and [..., G]")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2) * torch.exp2(scales.float() - 127)[..., None]  # [..., G, 32]
    return values.flatten(-2).to(dtype)
