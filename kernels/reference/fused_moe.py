"""A Mixture-of-Experts layer's experts in plain torch: the oracle of the fused MoE kernels.

The model computes the router's logits and picks each token's top-k experts itself; the
experts' part is `fused_moe_ref`:

    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e][:I] @ x[t]) * (w13[e][I:] @ x[t]))

for e = topk_ids[t, j] - expert_start. Expert parallelism: a rank holds experts
[expert_start, expert_start + E) of the model's, an id outside that range adds nothing, and
the ranks' partial outputs are summed (all-reduce) by the caller.

Weights: `w13` [E, 2 * I, H] (each expert's gate rows, then its up rows: HF's gate_proj stacked
over up_proj) and `w2` [E, H, I], both dense in x's dtype; or each a sequence of E
`QuantizedWeight`s ([2 * I, H] and [H, I]), which run through `quant_linear_ref` (dequantized
per call, computed in fp32 and rounded to x's dtype, as a quantized linear's reference).

Numerics: each expert's GEMMs run in x's dtype (torch's fp32 accumulation inside each GEMM,
rounded to x's dtype, SiLU * up in x's dtype); the routing weight multiplies in fp32 and the k
slots are summed in fp32, rounded to x's dtype once.

gpt-oss's experts (`ExpertVariant`) add biases, to each expert's gate_up output (`w13_bias`
[E, 2 * I], gate then up) before the activation and to its down output (`w2_bias` [E, H])
before the routing weight multiplies (inside the GEMMs here: F.linear's bias), and their own
activation, "swigluoai" (`swigluoai_and_mul_ref`: fp32, rounded once) in place of SiLU * up.

Routing without a per-token loop: `sort_by_expert` sorts the (token, slot) pairs by expert,
then one GEMM pair per expert that received tokens (`run_experts`, which the CPU backend
shares with its own per-expert kernels). `moe_align` is the same sort padded per expert to a
block of rows, the layout the Triton grouped GEMM reads (plain torch, no host sync).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from pdserve.kernels.checks import FLOAT_DTYPES, check_dtype, check_shape
from pdserve.kernels.quant_weights import QuantizedWeight
from pdserve.kernels.reference.quant_linear import quant_linear_ref
from pdserve.kernels.reference.silu_and_mul import silu_and_mul_ref
from pdserve.kernels.reference.swigluoai_and_mul import (
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    swigluoai_and_mul_ref,
)

logger = logging.getLogger(__name__)

ExpertWeights = torch.Tensor | Sequence[QuantizedWeight]  # [E, out, in], or E of [out, in]
ExpertMlp = Callable[[int, torch.Tensor], torch.Tensor]  # (local expert, rows [n, H]) -> [n, H]
ID_DTYPES = (torch.int32, torch.int64)
ACTIVATIONS = ("silu", "swigluoai")  # an expert's gated activation: SwiGLU's, gpt-oss's


def expert_shapes(w13: ExpertWeights, w2: ExpertWeights) -> tuple[int, int, int]:
    """(E, H, I) of a layer's experts; ValueError naming the fix where the two disagree."""
    if isinstance(w13, torch.Tensor) != isinstance(w2, torch.Tensor):
        raise ValueError("w13 and w2 must both be dense tensors or both QuantizedWeight lists")
    if isinstance(w13, torch.Tensor):
        if w13.dim() != 3 or w13.shape[1] % 2:
            raise ValueError(f"w13 must be [E, 2 * I, H], got {list(w13.shape)}")
        num_experts, hidden, inter = w13.shape[0], w13.shape[2], w13.shape[1] // 2
        check_shape("w2", w2, (num_experts, hidden, inter))
        return num_experts, hidden, inter
    if len(w13) == 0 or len(w13) != len(w2):
        raise ValueError(f"w13 and w2 must list the same experts, got {len(w13)} and {len(w2)}")
    if not all(isinstance(w, QuantizedWeight) for w in (*w13, *w2)):
        raise ValueError("quantized experts: w13 and w2 must be lists of QuantizedWeight")
    out13, hidden = w13[0].shape
    inter = out13 // 2
    if out13 % 2 or any(w.shape != (out13, hidden) for w in w13) or any(
            w.shape != (hidden, inter) for w in w2):
        raise ValueError(f"quantized experts must be w13 [2 * I, H] and w2 [H, I] each, got "
                         f"{w13[0].shape} and {w2[0].shape}")
    return len(w13), hidden, inter


def check_routing(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  hidden: int) -> None:
    """x [T, H] float; topk_weights [T, k] fp32; topk_ids [T, k] int32/int64."""
    check_shape("x", x, (None, hidden))
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("topk_ids", topk_ids, (x.shape[0], None))
    check_dtype("topk_ids", topk_ids, ID_DTYPES)
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    check_dtype("topk_weights", topk_weights, (torch.float32,))


def local_ids(topk_ids: torch.Tensor, num_experts: int, expert_start: int) -> torch.Tensor:
    """[T * k] each pair's local expert, `num_experts` for an expert another rank holds."""
    ids = topk_ids.reshape(-1).long() - expert_start
    outside = (ids < 0) | (ids >= num_experts)
    return ids.masked_fill(outside, num_experts)


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, expert_start: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the flat (token * k + slot) pair indices sorted by local expert
    (stable; pairs of other ranks' experts last) and each local expert's pair count [E]."""
    ids = local_ids(topk_ids, num_experts, expert_start)
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))  # bincount would sync on CUDA
    return order, counts[:num_experts]


def run_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                num_experts: int, expert_start: int, mlp: ExpertMlp) -> torch.Tensor:
    """The routing around one `mlp(e, rows)` call per local expert that received pairs: the
    pairs' rows gathered once in expert order (each expert's a contiguous slice), the outputs
    weighted in fp32 and added into fp32 sums in one pass."""
    num_tokens, top_k = topk_ids.shape
    order, counts = sort_by_expert(topk_ids, num_experts, expert_start)
    counts = counts.tolist()  # one host sync per layer
    pairs = order[:sum(counts)]  # [n] this rank's pairs, by expert
    tokens = pairs // top_k
    rows = x.index_select(0, tokens)  # [n, H]
    outs, start = [], 0
    for e, count in enumerate(counts):
        if count:
            outs.append(mlp(e, rows[start:start + count]))  # [count, H], x.dtype
            start += count
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    if outs:
        weights = topk_weights.reshape(-1).index_select(0, pairs)[:, None]  # [n, 1] fp32
        out.index_add_(0, tokens, torch.cat(outs) * weights)  # promoted to fp32
    return out.to(x.dtype)


def _linear(x: torch.Tensor, w: ExpertWeights, e: int, bias: torch.Tensor | None
            ) -> torch.Tensor:
    return quant_linear_ref(x, w[e], bias) if isinstance(w, Sequence) else F.linear(x, w[e], bias)


@dataclass(frozen=True, eq=False)
class ExpertVariant:
    """What a MoE layer's experts add to plain SwiGLU experts (the defaults: nothing): gpt-oss's
    biases and activation (module doc). Validated on construction; `checked` fits the biases to
    the experts' shapes and the activations' dtype."""

    w13_bias: torch.Tensor | None = None  # [E, 2 * I]: gate, then up
    w2_bias: torch.Tensor | None = None  # [E, H]
    activation: str = "silu"  # one of ACTIVATIONS
    swiglu_alpha: float = SWIGLU_ALPHA  # swigluoai only
    swiglu_limit: float = SWIGLU_LIMIT  # swigluoai only

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if not 0.0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite float > 0, got {value!r}")

    def checked(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype
                ) -> ExpertVariant:
        """The same, its biases checked against (E, H, I) and contiguous in `dtype`."""
        biases = []
        for name, shape in (("w13_bias", (num_experts, 2 * inter)),
                            ("w2_bias", (num_experts, hidden))):
            bias = getattr(self, name)
            if bias is not None:
                check_shape(name, bias, shape)
                check_dtype(name, bias, FLOAT_DTYPES)
                bias = bias.to(dtype).contiguous()
            biases.append(bias)
        return replace(self, w13_bias=biases[0], w2_bias=biases[1])

    def act_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [n, 2 * I] -> [n, I]
        """The activation in plain torch."""
        if self.activation == "silu":
            return silu_and_mul_ref(x)
        return swigluoai_and_mul_ref(x, self.swiglu_alpha, self.swiglu_limit)

    def biases(self, e: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Local expert e's (gate_up [2 * I], down [H]) biases, or None each."""
        return (None if self.w13_bias is None else self.w13_bias[e],
                None if self.w2_bias is None else self.w2_bias[e])

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(b for b in (self.w13_bias, self.w2_bias) if b is not None)


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: ExpertWeights,  # [E, 2 * I, H] (gate rows, then up rows)
    w2: ExpertWeights,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int64 (or int32), global expert ids
    *,
    expert_start: int = 0,
    w13_bias: torch.Tensor | None = None,  # [E, 2 * I]: gate, then up
    w2_bias: torch.Tensor | None = None,  # [E, H]
    activation: str = "silu",  # or "swigluoai" (gpt-oss)
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
) -> torch.Tensor:  # [T, H], x.dtype
    """The experts' weighted sum for each token (module doc); ids outside
    [expert_start, expert_start + E) contribute nothing."""
    variant = ExpertVariant(w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit)
    return experts_ref(x, w13, w2, topk_weights, topk_ids, expert_start, variant)


def experts_ref(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_start: int,
                variant: ExpertVariant) -> torch.Tensor:  # [T, H], x.dtype
    """`fused_moe_ref` with its variant as one value."""
    num_experts, hidden, inter = expert_shapes(w13, w2)
    check_routing(x, topk_weights, topk_ids, hidden)
    if isinstance(w13, torch.Tensor) and (w13.dtype != x.dtype or w2.dtype != x.dtype):
        raise ValueError(f"w13 and w2 must have x's dtype {x.dtype}, got {w13.dtype} and "
                         f"{w2.dtype}; prepare them with KernelBackend.prepare_experts")
    variant = variant.checked(num_experts, hidden, inter, x.dtype)

    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        b13, b2 = variant.biases(e)
        return _linear(variant.act_and_mul(_linear(rows, w13, e, b13)), w2, e, b2)

    return run_experts(x, topk_weights, topk_ids, num_experts, expert_start, mlp)


@dataclass(frozen=True)
class MoeAlignment:
    """The pairs sorted by expert, each expert's run padded to a multiple of `block_m` rows.

    Block b (rows [b * block_m, (b + 1) * block_m) of `sorted_ids`) holds pairs of local expert
    `block_experts[b]` only; padding rows hold T * k (no pair). Blocks past the padded total
    have expert -1 (the buffers are sized for the worst case, so no host sync is needed).
    """

    sorted_ids: torch.Tensor  # [num_blocks * block_m] int64 flat pair index, T * k = padding
    block_experts: torch.Tensor  # [num_blocks] int64 local expert, -1 = unused block
    block_m: int


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_start: int = 0
              ) -> MoeAlignment:
    """`sort_by_expert`, padded per expert to `block_m` rows (`MoeAlignment`), in torch ops
    with no host sync (each expert with pairs adds at most block_m - 1 padding rows)."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    order, counts = sort_by_expert(topk_ids, num_experts, expert_start)
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_blocks = -(-worst // block_m)
    # sorted position i (of expert e) goes to padded_start[e] + (i - start[e])
    ids = local_ids(topk_ids, num_experts, expert_start)[order]  # [T * k] ascending
    shift = torch.cat([padded_end - padded - (torch.cumsum(counts, 0) - counts),
                       torch.zeros(1, dtype=torch.int64, device=device)])
    dest = torch.arange(num_pairs, device=device) + shift[ids]
    dest = dest.masked_fill(ids == num_experts, num_blocks * block_m)  # other ranks': dropped
    sorted_ids = torch.full((num_blocks * block_m + 1,), num_pairs, dtype=torch.int64,
                            device=device)
    sorted_ids.scatter_(0, dest, order)
    starts = torch.arange(num_blocks, device=device) * block_m
    experts = torch.searchsorted(padded_end, starts, right=True)  # E past the padded total
    block_experts = experts.masked_fill(experts == num_experts, -1)
    return MoeAlignment(sorted_ids[:-1], block_experts, block_m)


@dataclass(frozen=True)
class ExpertsRef:
    """A layer's experts as loaded, run by `fused_moe_ref` (the `torch` backend's kernel)."""

    w13: ExpertWeights
    w2: ExpertWeights
    variant: ExpertVariant = field(default_factory=ExpertVariant)  # biases in w13's dtype

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 expert_start: int = 0) -> torch.Tensor:
        return experts_ref(x, self.w13, self.w2, topk_weights, topk_ids, expert_start,
                           self.variant)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return expert_tensors(self.w13) + expert_tensors(self.w2) + self.variant.tensors


@dataclass(frozen=True)
class LinearExperts:
    """Experts as 2E prepared linears (a backend's `LinearKernel`s, called as `kernel(x, bias)`),
    run one expert at a time on its sorted rows (`run_experts`) with the gated activation
    `act_and_mul` between: the CPU backend's experts, and quantized ones on the quantized linear
    kernels. Biases ([E, 2 * I], [E, H] in the activations' dtype, or None) go to the linears."""

    w13: tuple[Callable[..., torch.Tensor], ...]  # E of [2 * I, H]
    w2: tuple[Callable[..., torch.Tensor], ...]  # E of [H, I]
    hidden_size: int
    act_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_ref  # [n, 2I] -> [n, I]
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 expert_start: int = 0) -> torch.Tensor:  # [T, H], x.dtype
        check_routing(x, topk_weights, topk_ids, self.hidden_size)

        def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
            b13 = None if self.w13_bias is None else self.w13_bias[e]
            b2 = None if self.w2_bias is None else self.w2_bias[e]
            return self.w2[e](self.act_and_mul(self.w13[e](rows, b13)), b2)

        return run_experts(x, topk_weights, topk_ids, len(self.w13), expert_start, mlp)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        biases = tuple(b for b in (self.w13_bias, self.w2_bias) if b is not None)
        return tuple(t for k in (*self.w13, *self.w2) for t in k.tensors) + biases


def expert_tensors(w: ExpertWeights) -> tuple[torch.Tensor, ...]:
    if isinstance(w, torch.Tensor):
        return (w,)
    return tuple(t for q in w for t in (q.qweight, q.scales, q.offsets) if t is not None)


def cast_experts(w: ExpertWeights, dtype: torch.dtype) -> ExpertWeights:
    """Dense experts in the activations' dtype; quantized ones as they are (in a tuple)."""
    return w.to(dtype).contiguous() if isinstance(w, torch.Tensor) else tuple(w)
