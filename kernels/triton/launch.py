"""Launch helpers of the Triton kernels: interpreter or GPU, outputs, tile sizes, dot types."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton fixes interpreter-or-compiled when a kernel is defined, so read the flag once, at the
# import that precedes every kernel definition.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false")


def interpreting() -> bool:
    """True when the kernels run on Triton's CPU interpreter (tests only)."""
    return _INTERPRETED


def new_output(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An output tensor for a kernel to fill; poisoned under the interpreter (tests).

    NaN (or the dtype's minimum for integers) makes any element a kernel forgets to write
    fail the comparison with the reference instead of passing on lucky zeroed memory.
    """
    if not _INTERPRETED:
        return torch.empty(shape, dtype=dtype, device=device)
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
    return torch.full(shape, fill, dtype=dtype, device=device)


def pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(int(n)))


def num_programs_target(device: torch.device) -> int:
    """Programs a launch should offer to keep every SM busy (4 waves); 1 on the interpreter."""
    if device.type != "cuda":
        return 1
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def dot_dtype(cache_dtype: torch.dtype, q_dtype: torch.dtype) -> tl.dtype:
    """Operand type of tl.dot: native fp16/bf16 on a GPU (tensor cores), fp32 otherwise.

    int8 values (|q| <= 127) are exact in fp16 and bf16, so an int8 cache feeds the tensor
    cores in the query's half type. fp32 stays fp32 (with IEEE precision, not tf32). The
    interpreter computes bf16 wrongly, so there every operand is upcast to fp32.
    """
    if interpreting():
        return tl.float32
    half = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    if cache_dtype == torch.int8:
        return half.get(q_dtype, tl.float32)
    return half.get(cache_dtype, tl.float32)


def dot_precision(dtype: tl.dtype) -> str:
    """fp32 operands ask for exact products; tf32 would miss the fp32 error bound."""
    return "ieee" if dtype == tl.float32 else "tf32"
