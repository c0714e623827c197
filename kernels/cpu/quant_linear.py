"""Weight-only quantized linears on the CPU: torch's packed int4 and int8 matmuls.

`prepare` turns a `QuantizedWeight` into what the CPU op reads, once at load: a linear kernel
(`kernels.backend.LinearKernel`) called as `kernel(x, bias)`.

- int4, group size 32..256 (a power of two): `aten._weight_int4pack_mm_for_cpu`. Its weights
  are nibbles repacked for its AVX-512 kernel and per-group (scale, zero) pairs in the
  activation dtype, dequantized as (q - 8) * scale + zero, so zero = offset + 8 * scale.
- int8 per output channel: `aten._weight_int8pack_mm` (w = scale * q, scale in the activation
  dtype).
- anything else (group-wise int8 such as GGUF Q8_0 linears, odd group sizes): the torch
  reference, dequantizing per call (correct, slow; logged once at load).

The ops take the scales in the activation dtype, so in bf16 a scale is rounded to bf16: the
outputs differ from the fp32 reference by bf16 rounding (tests state the bound); in fp32 they
agree to fp32 rounding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.kernels.quant_weights import QuantizedWeight, unpack_int4
from pdserve.kernels.reference.linear import QuantLinearRef

logger = logging.getLogger(__name__)

INT4_INNER_K_TILES = 2  # the op's repacking granularity (it accepts 2, 4 or 8)


@dataclass(frozen=True)
class Int4Linear:
    """int4 nibbles repacked for `aten._weight_int4pack_mm_for_cpu`, with per-group (scale,
    zero) pairs in the activation dtype."""

    group_size: int
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor  # [in / group, out, 2]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed,
                                                        self.group_size, self.scales_and_zeros)
        return y if bias is None else y + bias

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed, self.scales_and_zeros)


@dataclass(frozen=True)
class Int8Linear:
    """int8 per output channel for `aten._weight_int8pack_mm` (scales in the activation dtype)."""

    packed: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.packed, self.scales)
        return y if bias is None else y + bias

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed, self.scales)


def _int4_group_ok(group_size: int) -> bool:
    return 32 <= group_size <= 256 and group_size & (group_size - 1) == 0


def prepare(w: QuantizedWeight, dtype: torch.dtype) -> Int4Linear | Int8Linear | QuantLinearRef:
    """`w` for activations of `dtype` on the CPU ops (see the module doc)."""
    if w.bits == 4 and _int4_group_ok(w.group_size) and w.in_features % w.group_size == 0:
        q = unpack_int4(w.qweight).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES)
        zeros = w.offsets + 8 * w.scales
        scales_and_zeros = torch.stack([w.scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
        return Int4Linear(w.group_size, packed, scales_and_zeros)
    if w.bits == 8 and w.group_size == w.in_features:
        return Int8Linear(w.qweight.contiguous(), w.scales[:, 0].to(dtype))
    logger.warning("int%d weights with group size %d run on the torch reference on the CPU "
                   "(dequantized per call)", w.bits, w.group_size)
    return QuantLinearRef(w)
