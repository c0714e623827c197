"""Weight-only quantized matrices: the int8 and int4 layouts, their quantizers and references.

One layout per bit width, whatever the source (round-to-nearest at load, GGUF, GPTQ, AWQ):

- int8: `qweight` int8 [out, in], `scales` fp32 [out, in / group]; w = scale * q (symmetric).
  `group_size == in` is per output channel (what `quantization="int8"` makes); GGUF Q8_0 is
  group 32.
- int4: `qweight` uint8 [out, in / 2], column 2j in the low nibble and 2j+1 in the high one,
  q in 0..15; `scales` and `offsets` fp32 [out, in / group]; w = scale * q + offset. Every 4-bit
  format is this affine form: GGUF Q4_1 (d, m), Q4_0 (offset -8d), GPTQ and AWQ (offset
  -scale * zero).

Scales and offsets are kept in fp32, so a format's fp16 parameters are held exactly and
`dequantize` reproduces its own dequantization bit for bit. Groups run along the input
dimension; tensor-parallel shards (`narrow`) cut whole groups only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

BITS = (4, 8)
DEFAULT_GROUP_SIZE = {4: 32, 8: 0}  # 0: per output channel (one group spanning the input)


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight-only quantized [out_features, in_features] matrix (see the module doc)."""

    bits: int
    group_size: int
    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None = None  # int4 only

    def __post_init__(self) -> None:
        out, cols = self.qweight.shape
        in_features = cols * 2 if self.bits == 4 else cols
        want = torch.uint8 if self.bits == 4 else torch.int8
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")
        if self.qweight.dtype != want:
            raise ValueError(f"int{self.bits} qweight must be {want}, got {self.qweight.dtype}")
        if self.group_size <= 0 or in_features % self.group_size or (
                self.bits == 4 and self.group_size % 2):
            raise ValueError(f"group_size {self.group_size} must divide in_features "
                             f"{in_features}")
        groups = (out, in_features // self.group_size)
        if tuple(self.scales.shape) != groups or self.scales.dtype != torch.float32:
            raise ValueError(f"scales must be fp32 {list(groups)}, got "
                             f"{self.scales.dtype} {list(self.scales.shape)}")
        if (self.offsets is None) != (self.bits == 8):
            raise ValueError("int4 needs offsets; int8 is symmetric and takes none")
        if self.offsets is not None and (tuple(self.offsets.shape) != groups
                                         or self.offsets.dtype != torch.float32):
            raise ValueError(f"offsets must be fp32 {list(groups)}")

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        tensors = (self.qweight, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Rows (dim 0) or input columns (dim 1) [start, start + length): whole groups only."""
        if dim == 0:
            return replace(self, **_map(self, lambda t: t.narrow(0, start, length)))
        g, per = self.group_size, 2 if self.bits == 4 else 1
        inside = start // g == (start + length - 1) // g  # within one group (per channel)
        if not inside and (start % g or length % g) or start % per or length % per:
            raise ValueError(f"a shard of input columns [{start}, {start + length}) must cut "
                             f"whole groups of {g}: choose a TP size whose shard width is a "
                             "multiple of the group size")
        g0, gn = start // g, 1 if inside else length // g
        return replace(
            self, group_size=length if inside else g,
            qweight=self.qweight.narrow(1, start // per, length // per),
            scales=self.scales.narrow(1, g0, gn),
            offsets=None if self.offsets is None else self.offsets.narrow(1, g0, gn))

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return replace(self, **_map(self, lambda t: t.to(device)))

    def contiguous(self) -> QuantizedWeight:
        return replace(self, **_map(self, lambda t: t.contiguous()))


def _map(w: QuantizedWeight, fn) -> dict:
    return {"qweight": fn(w.qweight), "scales": fn(w.scales),
            "offsets": None if w.offsets is None else fn(w.offsets)}


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Matrices stacked along the output dimension (a fused q/k/v or gate/up)."""
    first = parts[0]
    if any((p.bits, p.group_size, p.in_features) != (first.bits, first.group_size,
                                                     first.in_features) for p in parts):
        raise ValueError("fused sub-matrices must share bits, group size and in_features")
    return QuantizedWeight(
        first.bits, first.group_size, torch.cat([p.qweight for p in parts]),
        torch.cat([p.scales for p in parts]),
        None if first.offsets is None else torch.cat([p.offsets for p in parts]))


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n / 2] -> uint8 [..., n] nibbles, low nibble first."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] values in 0..15 -> uint8 [..., n / 2], column 2j in the low nibble."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The fp32 [out, in] matrix `w` stands for (the reference every kernel is checked on)."""
    q = (unpack_int4(w.qweight) if w.bits == 4 else w.qweight).float()
    out, cols = q.shape
    grouped = q.view(out, cols // w.group_size, w.group_size)
    values = grouped * w.scales[..., None]
    if w.offsets is not None:
        values = values + w.offsets[..., None]
    return values.view(out, cols)


def quantize(weight: torch.Tensor, bits: int, group_size: int = 0) -> QuantizedWeight:
    """Round-to-nearest weight-only quantization of a float [out, in] matrix.

    int8: symmetric, scale = max|w| / 127 per group. int4: affine over each group's [min, max]
    (min and max widened to include 0), scale = (max - min) / 15, offset = min. group_size 0:
    the bit width's default (per channel for int8, 32 for int4).
    """
    if bits not in BITS:
        raise ValueError(f"quantization bits must be one of {BITS}, got {bits}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a float matrix, got {weight.dtype} {list(weight.shape)}")
    out, cols = weight.shape
    group_size = group_size or DEFAULT_GROUP_SIZE[bits] or cols
    if group_size <= 0 or cols % group_size or (bits == 4 and group_size % 2):
        raise ValueError(f"quantization_group_size {group_size} must divide in_features "
                         f"{cols}" + (" and be even for int4" if bits == 4 else ""))
    w = weight.float().view(out, cols // group_size, group_size)
    if bits == 8:
        scales = w.abs().amax(-1) / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(w / scales[..., None]).clamp_(-127, 127).to(torch.int8)
        return QuantizedWeight(8, group_size, q.view(out, cols), scales)
    lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scales = (hi - lo) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp_(0, 15)
    return QuantizedWeight(4, group_size, pack_int4(q.view(out, cols)), scales, lo)
