"""A MoE layer's experts on the CPU: bf16 experts as one C call per layer (`fused_moe.c`).

At load every expert's w13 [2 * I, H] and w2 [H, I] become the CPU backend's linear kernels
(`CpuBackend._prepare`: bf16 packed for `linear_bf16.c`, all experts in one mapping of huge
pages, or for oneDNN; quantized ones for torch's int4/int8 ops; fp32 as `F.linear`).

Where every expert's two linears are packed for `linear_bf16.c` (bf16 on a CPU with
AVX512-BF16 or AVX2) and I and H are whole tiles, a call is `fused_moe.c`'s one function
(`BlockedExperts`): the sort by expert, every expert's gate/up GEMM, SiLU * up, down GEMM
and the fp32 weighted sum over the k slots in one OpenMP region, bit-identical to the
per-expert path below. At a decode step that replaces ~40 OpenMP regions per layer (each a
barrier that waits for the slowest thread) and the Python around them.

Everywhere else (fp32 experts, quantized experts, bf16 in oneDNN's layout, I not a whole
number of tiles) the experts stay `kernels.reference.fused_moe.LinearExperts`: the pairs
sorted by expert in torch, one GEMM pair per expert that received tokens with SiLU * up in C
between them, and the reference's fp32 sum over the k slots.

gpt-oss's experts (`ExpertVariant`: biases, the "swigluoai" activation) take both paths: the
biases go to each expert's linears (in the C call, into its GEMM tiles' sums), swigluoai
(`swigluoai_and_mul.c`) replaces SiLU * up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.kernels.backend import ExpertsKernel, ExpertWeights, LinearKernel, Weight
from pdserve.kernels.cpu import build, huge_pages, packed_linear
from pdserve.kernels.cpu.packed_linear import BlockedLinear
from pdserve.kernels.cpu.silu_and_mul import silu_and_mul_cpu
from pdserve.kernels.cpu.swigluoai_and_mul import swigluoai_and_mul_cpu
from pdserve.kernels.quant_weights import QuantizedWeight
from pdserve.kernels.reference.fused_moe import (
    ExpertVariant,
    LinearExperts,
    check_routing,
    expert_shapes,
)

PrepareLinear = Callable[[Weight, torch.dtype, huge_pages.Arena], LinearKernel]


def prepare_experts(w13: ExpertWeights, w2: ExpertWeights, dtype: torch.dtype,
                    prepare_linear: PrepareLinear, variant: ExpertVariant | None = None
                    ) -> ExpertsKernel:
    """The experts' 2E linears through `prepare_linear` (the backend's), the packed bf16 ones
    in one arena of huge pages; run by `fused_moe.c` where they are all blocked bf16."""
    num_experts, hidden, inter = expert_shapes(w13, w2)
    variant = (variant or ExpertVariant()).checked(num_experts, hidden, inter, dtype)
    linears = [_as_dtype(w, dtype) for w in (*w13, *w2)]  # per expert: [2I, H], then [H, I]
    memory = huge_pages.Arena(packed_linear.blocked_bytes(w) for w in linears
                              if not isinstance(w, QuantizedWeight))
    kernels = tuple(prepare_linear(w, dtype, memory) for w in linears)
    w13_kernels, w2_kernels = kernels[:num_experts], kernels[num_experts:]
    if _fused_available() and all(isinstance(k, BlockedLinear) for k in kernels) and (
            inter % packed_linear.tile_cols() == 0):
        return BlockedExperts(w13_kernels, w2_kernels, hidden, inter, variant)
    return LinearExperts(w13_kernels, w2_kernels, hidden, _act_and_mul(variant),
                         variant.w13_bias, variant.w2_bias)


def _act_and_mul(variant: ExpertVariant) -> Callable[[torch.Tensor], torch.Tensor]:
    """The variant's activation in C (bf16; the reference for other dtypes)."""
    if variant.activation == "silu":
        return silu_and_mul_cpu
    return functools.partial(swigluoai_and_mul_cpu, alpha=variant.swiglu_alpha,
                             limit=variant.swiglu_limit)


def _as_dtype(w: Weight, dtype: torch.dtype) -> Weight:
    return w if isinstance(w, QuantizedWeight) else w.to(dtype).contiguous()


def _kernel():
    return build.function(
        "fused_moe", "fused_moe_bf16",
        (build.PTR, build.PTR, build.PTR, build.INT, build.PTR, build.PTR, build.PTR, build.PTR,
         build.INT, build.FLOAT, build.FLOAT, build.PTR) + (build.I64,) * 6, build.INT)


@functools.cache
def _fused_available() -> bool:
    """Whether `fused_moe.c` built here with the packed layout `packed_linear` packs (the
    tile width checked: the library includes linear_bf16.c, which its cache key misses)."""
    cols = build.function("fused_moe", "fused_moe_tile_cols", (), build.INT)
    return cols is not None and _kernel() is not None and cols() == packed_linear.tile_cols() > 0


@dataclass(frozen=True)
class BlockedExperts:
    """bf16 experts packed for `linear_bf16.c`, run by `fused_moe.c` in one call per layer
    (the module doc); `w13` / `w2` are the experts' packed linears, which it keeps alive, with
    their variant (biases bf16, checked)."""

    w13: tuple[BlockedLinear, ...]  # E of [2 * I, H]
    w2: tuple[BlockedLinear, ...]  # E of [H, I]
    hidden_size: int
    intermediate_size: int
    variant: ExpertVariant = field(default_factory=ExpertVariant)

    @functools.cached_property
    def _pointers(self) -> tuple[torch.Tensor, torch.Tensor]:  # [E] int64 each: packed weights
        return tuple(torch.tensor([k.packed.data_ptr() for k in w], dtype=torch.int64)
                     for w in (self.w13, self.w2))

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 expert_start: int = 0) -> torch.Tensor:  # [T, H] bf16
        check_routing(x, topk_weights, topk_ids, self.hidden_size)
        if x.dtype != torch.bfloat16:
            raise ValueError(f"fused_moe: these experts were prepared for bfloat16, got x "
                             f"{x.dtype}; pass activations in the dtype given prepare_experts")
        num_tokens, top_k = topk_ids.shape
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if num_tokens == 0:
            return out
        x, weights, ids = x.contiguous(), topk_weights.contiguous(), topk_ids.contiguous()
        w13, w2 = self._pointers
        v = self.variant
        b13, b2 = (None if b is None else b.data_ptr() for b in (v.w13_bias, v.w2_bias))
        if _kernel()(x.data_ptr(), weights.data_ptr(), ids.data_ptr(),
                     int(ids.dtype == torch.int32), w13.data_ptr(), w2.data_ptr(), b13, b2,
                     int(v.activation == "swigluoai"), v.swiglu_alpha, v.swiglu_limit,
                     out.data_ptr(), num_tokens, top_k, len(self.w13), expert_start,
                     self.hidden_size, self.intermediate_size):
            raise MemoryError("fused_moe: out of memory for the sorted rows")
        return out

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(k.packed for k in (*self.w13, *self.w2)) + self.variant.tensors
