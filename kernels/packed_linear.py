"""Linear layers with their weights packed once at load: the CPU's bf16 matmuls.

Where the CPU has AVX512-BF16 or AVX2 and the weight tiles (out_features % `tile_cols()` == 0,
in_features even), the weight is packed for `linear_bf16_cpu.c`. With AVX512-BF16 a decode
step's few rows stream the weights at 25-40 GB/s, where oneDNN's kernels reach 15-20, and a
prefill's thousands of rows run 0-14% behind oneDNN. With AVX2 alone (no bf16 instructions)
torch's bf16 matmul falls back to a reference loop (0.8 GFLOP/s on 2 Zen 3 cores) where this
runs at 90-140. Elsewhere the weight is packed for oneDNN
(`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing does): `F.linear` on a
bf16 CPU tensor would reorder the weight into oneDNN's layout on every call, reading each
weight about three times.

Either way the layer keeps one copy of its weight, in the packed form only.
fp32 keeps `F.linear` (MKL): the exact-parity path, token-identical to transformers.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pdserve.kernels import huge_pages, native

BATCH_HINT = 32  # rows oneDNN tunes its packed layout for; any row count runs on it


def _kernel():
    return native.function("linear_bf16_cpu", "linear_bf16", (native.PTR,) * 4 + (native.I64,) * 3,
                           native.INT)


@functools.cache
def tile_cols() -> int:
    """Output columns per tile of `linear_bf16_cpu.c`'s layout on this CPU (64 with
    AVX512-BF16, 16 with AVX2), 0 where it does not run (not built, or neither present)."""
    cols = native.function("linear_bf16_cpu", "linear_bf16_tile_cols", (), native.INT)
    return cols() if cols is not None else 0


def blocked_available() -> bool:
    """Whether this CPU runs `linear_bf16_cpu.c`."""
    return tile_cols() > 0


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and (_fits_blocked(weight) or onednn_bf16())
    )


def pack(weight: torch.Tensor, memory: huge_pages.Arena | None = None) -> torch.Tensor:
    """The weight ([out, in]) in its kernel's layout: blocked ([out / c, in / 2, c, 2] for c =
    `tile_cols()`, a plain tensor, taken from `memory` where given) for `linear_bf16_cpu.c`,
    else an opaque mkldnn tensor for oneDNN."""
    if _fits_blocked(weight):
        out_features, in_features = weight.shape
        cols = tile_cols()
        tiles = weight.reshape(out_features // cols, cols, in_features // 2, 2).permute(0, 2, 1, 3)
        if memory is None:
            return tiles.contiguous()
        return memory.take(tuple(tiles.shape), tiles.dtype).copy_(tiles)
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)


def blocked_bytes(weight: torch.Tensor | None) -> int:
    """The bytes `pack` takes from its `memory` for this weight (0: none, or not packable)."""
    if weight is None or not can_pack(weight) or not _fits_blocked(weight):
        return 0
    return weight.numel() * weight.element_size()


def linear(
    x: torch.Tensor,  # [num_tokens, in]
    weight: torch.Tensor,  # [out, in], or its `pack`ed form
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [num_tokens, out]
    if weight.dim() == 4:
        return _linear_blocked(x, weight, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _linear_blocked(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                    ) -> torch.Tensor:
    tiles, pairs, cols, _ = packed.shape
    out_features, in_features = tiles * cols, pairs * 2
    if x.dtype != torch.bfloat16 or x.shape[-1] != in_features:
        raise ValueError(f"linear: x must be bfloat16 [..., {in_features}], got {x.dtype} "
                         f"{list(x.shape)}")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (out_features,)
                             or not bias.is_contiguous()):
        raise ValueError(f"linear: bias must be contiguous bfloat16 [{out_features}]")
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, in_features).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
    if rows.shape[0] and _kernel()(rows.data_ptr(), packed.data_ptr(),
                                   None if bias is None else bias.data_ptr(), out.data_ptr(),
                                   rows.shape[0], out_features, in_features):
        raise MemoryError("linear: out of memory for the input rows")
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out_features)


def _fits_blocked(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return blocked_available() and out_features % tile_cols() == 0 and in_features % 2 == 0


def onednn_bf16() -> bool:
    """Whether torch's bf16 linear has a oneDNN kernel here (none on AVX2-only CPUs)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
