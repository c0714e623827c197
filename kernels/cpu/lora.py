"""Batched multi-LoRA on the CPU: shrink and expand each one C call per linear (`lora.c`), its
loop over the step's segments in C; the reference's numerics (fp32 sums, y rounded once).

The glue is lean (a decode step calls it twice per linear): plain attribute checks, the C
functions and each slice layout's offsets looked up once.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels.cpu import build
from pdserve.kernels.lora_mapping import LoRAMapping
from pdserve.kernels.reference.lora import lora_expand_ref, lora_shrink_ref

_DTYPES = {torch.float32: build.DTYPE_CODES["float32"],
           torch.bfloat16: build.DTYPE_CODES["bfloat16"]}
_SHRINK = (build.PTR,) * 5 + (build.I64,) * 4 + (build.INT,)
_EXPAND = (build.PTR,) * 4 + (build.I64,) + (build.PTR,) * 2 + (build.I64,) * 4 + (build.INT,)


@functools.cache
def _kernel(symbol: str):
    return build.function("lora", symbol, _SHRINK if symbol == "lora_shrink" else _EXPAND,
                          ctypes.c_int)


@functools.cache
def _offsets(slice_offsets: tuple[int, ...]) -> ctypes.Array:
    """The slice offsets as the C reads them: int64 [slices + 1], checked once per layout."""
    if slice_offsets[0] != 0 or any(lo >= hi for lo, hi in zip(slice_offsets, slice_offsets[1:])):
        raise ValueError(f"slice offsets must rise from 0, got {slice_offsets}")
    return (ctypes.c_int64 * len(slice_offsets))(*slice_offsets)


def _dtype_code(mapping: LoRAMapping, x: torch.Tensor, w: torch.Tensor) -> int | None:
    """x's dtype as the C names it, where the C takes x and w (CPU, contiguous, both fp32 or
    both bf16, 2-D and 3-D; the mapping's segments int32 on the CPU); else None."""
    starts, slots = mapping.segment_starts, mapping.segment_slots
    plain = (x.is_cpu and w.is_cpu and w.dtype == x.dtype and x.dim() == 2 and w.dim() == 3
             and x.is_contiguous() and w.is_contiguous() and starts.is_cpu and slots.is_cpu
             and starts.dtype == torch.int32 and slots.dtype == torch.int32)
    return _DTYPES.get(x.dtype) if plain else None


def _check(mapping: LoRAMapping, num_tokens: int, num_slots: int) -> None:
    if mapping.token_slots.shape[0] != num_tokens:
        raise ValueError(f"the mapping is for {mapping.token_slots.shape[0]} tokens, got "
                         f"{num_tokens}")
    if mapping.slots and mapping.slots[-1] >= num_slots:
        raise ValueError(f"slot {mapping.slots[-1]} out of the weights' {num_slots} slots")


def lora_shrink_cpu(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, R, in], x.dtype
    mapping: LoRAMapping,
) -> torch.Tensor:  # [T, R] fp32
    """`lora_shrink_ref` in one C call (`lora.c`); what the C does not take goes to the ref."""
    kernel = _kernel("lora_shrink")
    code = _dtype_code(mapping, x, a)
    if kernel is None or code is None:
        return lora_shrink_ref(x, a, mapping)
    (num_tokens, dim), (num_slots, width, a_dim) = x.shape, a.shape
    if a_dim != dim:
        raise ValueError(f"a must be [slots, R, {dim}], got {tuple(a.shape)}")
    _check(mapping, num_tokens, num_slots)
    buf = torch.empty(num_tokens, width, dtype=torch.float32)
    slots = mapping.segment_slots
    if kernel(x.data_ptr(), a.data_ptr(), buf.data_ptr(), mapping.segment_starts.data_ptr(),
              slots.data_ptr(), slots.shape[0], num_tokens, dim, width, code):
        raise MemoryError("lora_shrink: out of memory")
    return buf


def lora_expand_cpu(
    y: torch.Tensor,  # [T, out]
    buf: torch.Tensor,  # [T, R] fp32
    b: torch.Tensor,  # [slots, out, rank], y.dtype
    mapping: LoRAMapping,
    slice_offsets: tuple[int, ...],  # 0 = o_0 < ... < o_slices = out
) -> None:
    """`lora_expand_ref` in one C call (`lora.c`), in place on y; other layouts go to the ref."""
    kernel = _kernel("lora_expand")
    code = _dtype_code(mapping, y, b)
    if (kernel is None or code is None or buf.dtype != torch.float32 or not buf.is_cpu
            or not buf.is_contiguous()):
        lora_expand_ref(y, buf, b, mapping, slice_offsets)
        return
    (num_tokens, out), (num_slots, b_out, rank) = y.shape, b.shape
    num_slices = len(slice_offsets) - 1
    offsets = _offsets(tuple(slice_offsets))
    if b_out != out or slice_offsets[-1] != out or buf.shape != (num_tokens, num_slices * rank):
        raise ValueError(f"y {tuple(y.shape)}, buf {tuple(buf.shape)}, b {tuple(b.shape)} and "
                         f"slice offsets {slice_offsets} do not agree")
    _check(mapping, num_tokens, num_slots)
    slots = mapping.segment_slots
    if kernel(y.data_ptr(), buf.data_ptr(), b.data_ptr(), offsets, num_slices,
              mapping.segment_starts.data_ptr(), slots.data_ptr(), slots.shape[0], num_tokens,
              out, rank, code):
        raise MemoryError("lora_expand: out of memory")
