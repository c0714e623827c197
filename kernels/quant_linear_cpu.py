"""Weight-only quantized linears on the CPU: torch's packed int4 and int8 matmuls.

`prepare` turns a `QuantizedWeight` into what the CPU op reads, once at load; `linear` runs it.

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
import torch.nn.functional as F

from pdserve.kernels.quant_weights import QuantizedWeight, dequantize, unpack_int4

logger = logging.getLogger(__name__)

INT4_INNER_K_TILES = 2  # the op's repacking granularity (it accepts 2, 4 or 8)


@dataclass(frozen=True)
class PreparedWeight:
    """A QuantizedWeight in the form `linear` runs on `kind`'s op (only that form is kept)."""

    kind: str  # "int4" | "int8" | "reference"
    group_size: int
    packed: torch.Tensor | None = None  # the op's weight tensor
    scales: torch.Tensor | None = None  # the op's scale tensor, in the activation dtype
    reference: QuantizedWeight | None = None  # kind "reference" only

    @property
    def nbytes(self) -> int:
        if self.reference is not None:
            return self.reference.nbytes
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))


def _int4_group_ok(group_size: int) -> bool:
    return 32 <= group_size <= 256 and group_size & (group_size - 1) == 0


def prepare(w: QuantizedWeight, dtype: torch.dtype) -> PreparedWeight:
    """`w` for activations of `dtype` on the CPU ops (see the module doc)."""
    if w.bits == 4 and _int4_group_ok(w.group_size) and w.in_features % w.group_size == 0:
        q = unpack_int4(w.qweight).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES)
        zeros = w.offsets + 8 * w.scales
        scales_and_zeros = torch.stack([w.scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
        return PreparedWeight("int4", w.group_size, packed, scales_and_zeros)
    if w.bits == 8 and w.group_size == w.in_features:
        return PreparedWeight("int8", w.group_size, w.qweight.contiguous(),
                              w.scales[:, 0].to(dtype))
    logger.warning("int%d weights with group size %d run on the torch reference on the CPU "
                   "(dequantized per call)", w.bits, w.group_size)
    return PreparedWeight("reference", w.group_size, reference=w)


def linear(x: torch.Tensor, w: PreparedWeight, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """y = x W^T (+ bias) for x [T, in] on the prepared weight; out [T, out] in x's dtype."""
    x = x.contiguous()
    if w.kind == "int4":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, w.group_size, w.scales)
    elif w.kind == "int8":
        y = torch.ops.aten._weight_int8pack_mm(x, w.packed, w.scales)
    else:
        y = F.linear(x.float(), dequantize(w.reference)).to(x.dtype)
    return y if bias is None else y + bias
