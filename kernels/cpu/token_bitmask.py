"""Structured outputs' token mask on the CPU: one C pass (`token_bitmask.c`) over fp32 logits."""

from __future__ import annotations

import torch

from pdserve.kernels.cpu import build
from pdserve.kernels.reference.token_bitmask import apply_token_bitmask_ref


def _kernel():
    return build.function("token_bitmask", "apply_token_bitmask_f32",
                          (build.PTR, build.PTR, build.I64, build.I64, build.I64))


def apply_token_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    kernel = _kernel()
    if (kernel is None or logits.dtype != torch.float32 or not logits.is_contiguous()
            or bitmask.device.type != "cpu" or bitmask.shape[0] != logits.shape[0]):
        apply_token_bitmask_ref(logits, bitmask)
        return
    bitmask = bitmask.contiguous()
    assert bitmask.dtype == torch.int32 and bitmask.shape[1] * 32 >= logits.shape[1]
    kernel(logits.data_ptr(), bitmask.data_ptr(), logits.shape[0], logits.shape[1],
           bitmask.shape[1])
