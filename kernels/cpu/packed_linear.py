"""Linear layers with their weights packed once at load: the CPU's bf16 matmuls.

Where the CPU has AVX512-BF16 or AVX2 and the weight tiles (out_features % `tile_cols()` == 0,
in_features even), the weight is packed for `linear_bf16.c` (`BlockedLinear`). With AVX512-BF16
a decode step's few rows stream the weights at 25-40 GB/s, where oneDNN's kernels reach 15-20,
and a prefill's thousands of rows run 0-14% behind oneDNN. With AMX as well (Sapphire Rapids and
later), 2 rows or more go through the tile unit from the same layout: 1.1-9.5x faster than
without it, and ahead of oneDNN's AMX kernels at 16 rows and more. With AVX2 alone (no bf16
instructions) torch's bf16 matmul falls back to a reference loop (0.8 GFLOP/s on 2 Zen 3 cores)
where this runs at 90-140. Elsewhere the weight is packed for oneDNN (`OneDnnLinear`:
`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing does): `F.linear` on a
bf16 CPU tensor would reorder the weight into oneDNN's layout on every call, reading each weight
about three times.

Either way the layer keeps one copy of its weight, in the packed form only.
fp32 keeps `F.linear` (MKL, `kernels.reference.linear.DenseLinear`): the exact-parity path,
token-identical to transformers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pdserve.kernels.cpu import build, huge_pages

BATCH_HINT = 32  # rows oneDNN tunes its packed layout for; any row count runs on it


def _kernel():
    return build.function("linear_bf16", "linear_bf16", (build.PTR,) * 4 + (build.I64,) * 3,
                          build.INT)


@functools.cache
def tile_cols() -> int:
    """Output columns per tile of `linear_bf16.c`'s layout on this CPU (64 with
    AVX512-BF16, 16 with AVX2), 0 where it does not run (not built, or neither present)."""
    cols = build.function("linear_bf16", "linear_bf16_tile_cols", (), build.INT)
    return cols() if cols is not None else 0


@functools.cache
def amx() -> bool:
    """Whether `linear_bf16.c` sends 2 rows or more through AMX's tile unit on this CPU."""
    uses = build.function("linear_bf16", "linear_bf16_amx", (), build.INT)
    return bool(uses()) if uses is not None else False


def blocked_available() -> bool:
    """Whether this CPU runs `linear_bf16.c`."""
    return tile_cols() > 0


def onednn_bf16() -> bool:
    """Whether torch's bf16 linear has a oneDNN kernel here (none on AVX2-only CPUs)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@dataclass(frozen=True)
class BlockedLinear:
    """A bf16 weight in `linear_bf16.c`'s layout: [out / c, in / 2, c, 2] for c = `tile_cols()`."""

    packed: torch.Tensor

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        tiles, pairs, cols, _ = self.packed.shape
        out_features, in_features = tiles * cols, pairs * 2
        if x.dtype != torch.bfloat16 or x.shape[-1] != in_features:
            raise ValueError(f"linear: x must be bfloat16 [..., {in_features}], got {x.dtype} "
                             f"{list(x.shape)}")
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (out_features,)
                                 or not bias.is_contiguous()):
            raise ValueError(f"linear: bias must be contiguous bfloat16 [{out_features}]")
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, in_features).contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
        if rows.shape[0] and _kernel()(rows.data_ptr(), self.packed.data_ptr(),
                                       None if bias is None else bias.data_ptr(),
                                       out.data_ptr(), rows.shape[0], out_features, in_features):
            raise MemoryError("linear: out of memory for the input rows")
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out_features)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed,)


@dataclass(frozen=True)
class OneDnnLinear:
    """A bf16 weight in oneDNN's opaque layout (an mkldnn tensor)."""

    packed: torch.Tensor

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed,)


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and (_fits_blocked(weight) or onednn_bf16())
    )


def pack(weight: torch.Tensor, memory: huge_pages.Arena | None = None
         ) -> BlockedLinear | OneDnnLinear:
    """The weight ([out, in], `can_pack`) in its kernel's layout: blocked for `linear_bf16.c`
    (a plain tensor, taken from `memory` where given), else an opaque mkldnn tensor."""
    if _fits_blocked(weight):
        out_features, in_features = weight.shape
        cols = tile_cols()
        tiles = weight.reshape(out_features // cols, cols, in_features // 2, 2).permute(0, 2, 1, 3)
        if memory is None:
            return BlockedLinear(tiles.contiguous())
        return BlockedLinear(memory.take(tuple(tiles.shape), tiles.dtype).copy_(tiles))
    return OneDnnLinear(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT))


def blocked_bytes(weight: torch.Tensor) -> int:
    """The bytes `pack` takes from its `memory` for this weight (0: not packed blocked)."""
    if not can_pack(weight) or not _fits_blocked(weight):
        return 0
    return weight.numel() * weight.element_size()


def _fits_blocked(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return blocked_available() and out_features % tile_cols() == 0 and in_features % 2 == 0
