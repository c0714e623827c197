"""gpt-oss's experts in the fused-MoE op: biases on each expert's gate_up and down outputs and
the "swigluoai" activation (`ExpertVariant`).

The oracle is a loop written like transformers' `GptOssExperts.forward` (expert by expert over
the tokens routed to it, `index_add_` of the weighted outputs) on the checkpoint's layout:
gate_up_proj [E, H, 2I] with gate and up interleaved column by column, down_proj [E, I, H], in
float64. The test de-interleaves them into the op's w13 [E, 2I, H] (gate rows, then up rows)
and w2 [E, H, I], as the loader does. Then the CPU backend's experts (fp32 per expert; bf16 in
one `fused_moe.c` call, held bit for bit to the per-expert path with `swigluoai_and_mul.c`
between) and the Triton grouped GEMM (interpreter) against the reference, dense and quantized.

The gate_up weights are drawn 3x larger than 1/sqrt(H) so that gate and up often pass the
limit (7) and the clamps matter. Tolerances as test_fused_moe.py's (assert_close atol = rtol):
fp32 1e-5; bf16 3e-2, and 5e-2 where the bf16 outputs, of magnitude up to ~30 here, meet
each implementation's own rounding points (the reference and transformers round the
activation's inputs to bf16 and the C and Triton kernels differ in where they round, a bf16
step at 30 being 0.125).
"""

from __future__ import annotations

import functools

import pytest
import torch

from pdserve.kernels.backend import get_backend
from pdserve.kernels.cpu import packed_linear
from pdserve.kernels.cpu.backend import CpuBackend
from pdserve.kernels.cpu.fused_moe import BlockedExperts
from pdserve.kernels.cpu.silu_and_mul import silu_and_mul_cpu
from pdserve.kernels.cpu.swigluoai_and_mul import swigluoai_and_mul_cpu
from pdserve.kernels.quant_weights import dequantize, quantize
from pdserve.kernels.reference.fused_moe import ExpertsRef, LinearExperts, fused_moe_ref
from pdserve.kernels.reference.swigluoai_and_mul import swigluoai_and_mul_ref
from pdserve.kernels.triton import fused_moe as triton_moe  # its classes, unswapped in GPU mode
from pdserve.kernels.triton.fused_moe import fused_moe

E, H, INTER = 8, 192, 128  # multiples of the CPU's 64-column tiles: bf16 runs fused_moe.c
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
ALPHA, LIMIT = 1.702, 7.0
needs_cpu = pytest.mark.skipif(not CpuBackend.available(), reason="no C compiler: no cpu backend")
needs_blocked = pytest.mark.skipif(
    not CpuBackend.available() or not packed_linear.blocked_available(),
    reason="neither AVX512-BF16 nor AVX2 here: bf16 experts keep oneDNN's per-expert path")


def checkpoint(num_experts: int = E, hidden: int = H, inter: int = INTER, seed: int = 0
               ) -> dict[str, torch.Tensor]:
    """A gpt-oss MoE layer's experts as transformers holds them (fp32)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "gate_up_proj": torch.randn(num_experts, hidden, 2 * inter, generator=g) * 3 / hidden**0.5,
        "gate_up_proj_bias": torch.randn(num_experts, 2 * inter, generator=g),
        "down_proj": torch.randn(num_experts, inter, hidden, generator=g) / inter**0.5,
        "down_proj_bias": torch.randn(num_experts, hidden, generator=g),
    }


def de_interleaved(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The op's layout: w13 [E, 2I, H] gate rows then up rows, w13_bias [E, 2I] likewise,
    w2 [E, H, I], w2_bias [E, H]."""
    gate_up, bias = ckpt["gate_up_proj"], ckpt["gate_up_proj_bias"]
    w13 = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)
    return {"w13": w13.contiguous(), "w2": ckpt["down_proj"].transpose(1, 2).contiguous(),
            "w13_bias": torch.cat([bias[:, ::2], bias[:, 1::2]], dim=-1),
            "w2_bias": ckpt["down_proj_bias"]}


def interleaved(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`de_interleaved` undone: the checkpoint's layout of the op's weights."""
    def pairs(t: torch.Tensor) -> torch.Tensor:  # [..., 2I] gate | up -> gate, up alternating
        gate, up = t.chunk(2, dim=-1)
        return torch.stack([gate, up], dim=-1).flatten(-2)

    return {"gate_up_proj": pairs(w["w13"].transpose(1, 2)), "gate_up_proj_bias": pairs(
        w["w13_bias"]), "down_proj": w["w2"].transpose(1, 2), "down_proj_bias": w["w2_bias"]}


def gpt_oss_experts(x, ckpt, router_indices, routing_weights, expert_start=0,
                    alpha=ALPHA, limit=LIMIT):
    """`GptOssExperts.forward` in float64, ids outside [expert_start, expert_start + E) of
    another rank (nothing added)."""
    ckpt = {k: v.double() for k, v in ckpt.items()}
    num_experts = ckpt["gate_up_proj"].shape[0]
    hidden_states = x.double()
    next_states = torch.zeros_like(hidden_states)
    local = router_indices - expert_start
    for expert_idx in range(num_experts):
        top_k_pos, token_idx = torch.where((local == expert_idx).T)
        if token_idx.numel() == 0:
            continue
        current_state = hidden_states[token_idx]
        gate_up = (current_state @ ckpt["gate_up_proj"][expert_idx]
                   + ckpt["gate_up_proj_bias"][expert_idx])
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # _apply_gate
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * alpha)
        gated_output = (up + 1) * glu
        out = gated_output @ ckpt["down_proj"][expert_idx] + ckpt["down_proj_bias"][expert_idx]
        weighted_output = out * routing_weights[token_idx, top_k_pos, None].double()
        next_states.index_add_(0, token_idx, weighted_output)
    return next_states


def routing(tokens: int, top_k: int, num_ids: int, seed: int = 1):
    """(topk_weights [T, k] fp32 summing to 1, topk_ids [T, k] int64 distinct per token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, num_ids, generator=g).argsort(-1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids


def close(got, want, tol, dtype):
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


def oai(w: dict[str, torch.Tensor], dtype: torch.dtype | None = None, **kw) -> dict:
    """The op's gpt-oss keywords (biases in `dtype` when given)."""
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
    return {"w13_bias": cast(w["w13_bias"]), "w2_bias": cast(w["w2_bias"]),
            "activation": "swigluoai", **kw}


# (tokens, top_k, expert_start, ids drawn from): decode-sized top-4 (gpt-oss's k), a prefill's
# 40 tokens, expert parallelism (ids of two other ranks' experts below and above)
ROUTINGS = {"t3_top4": (3, 4, 0, E), "t40_top4": (40, 4, 0, E), "ep": (9, 2, 2, E + 4)}


@pytest.mark.parametrize("case", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_gpt_oss_experts(case, dtype):
    tokens, top_k, start, num_ids = ROUTINGS[case]
    ckpt = checkpoint()
    w = de_interleaved(ckpt)
    weights, ids = routing(tokens, top_k, num_ids)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    if dtype != torch.float32:  # the oracle on the same (rounded) weights
        ckpt = {k: v.to(dtype) for k, v in ckpt.items()}
        w = de_interleaved(ckpt)
    want = gpt_oss_experts(x, ckpt, ids, weights, start)
    got = fused_moe_ref(x, w["w13"].to(dtype), w["w2"].to(dtype), weights, ids,
                        expert_start=start, **oai(w, dtype))
    assert (want.abs() > 1).float().mean() > 0.5  # outputs that the biases and clamps move
    close(got, want, TOL[dtype] if dtype == torch.float32 else 5e-2, dtype)


def test_alpha_and_limit_are_the_callers():
    ckpt = checkpoint(seed=3)
    w = de_interleaved(ckpt)
    assert all(torch.equal(t, ckpt[name]) for name, t in interleaved(w).items())
    weights, ids = routing(5, 2, E)
    x = torch.randn(5, H)
    want = gpt_oss_experts(x, ckpt, ids, weights, alpha=1.0, limit=2.0)
    got = fused_moe_ref(x, w["w13"], w["w2"], weights, ids,
                        **oai(w, swiglu_alpha=1.0, swiglu_limit=2.0))
    close(got, want, 1e-5, torch.float32)


@needs_cpu
def test_swigluoai_and_mul_cpu_matches_reference():
    x = (torch.randn(70, 2 * 96, generator=torch.Generator().manual_seed(4)) * 6).bfloat16()
    close(swigluoai_and_mul_cpu(x, 1.5, 5.0), swigluoai_and_mul_ref(x, 1.5, 5.0), 1e-2,
          torch.bfloat16)  # one bf16 step at most: the sigmoid's last fp32 bit
    assert torch.equal(swigluoai_and_mul_cpu(x.float()), swigluoai_and_mul_ref(x.float()))


@needs_cpu
@pytest.mark.parametrize("case", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_experts_match_the_reference(case, dtype):
    tokens, top_k, start, num_ids = ROUTINGS[case]
    w = de_interleaved(checkpoint())
    weights, ids = routing(tokens, top_k, num_ids)
    x = torch.randn(tokens, H).to(dtype)
    kernel = get_backend("cpu").prepare_experts(w["w13"], w["w2"], dtype, **oai(w))
    blocked = dtype == torch.bfloat16 and packed_linear.blocked_available()
    assert isinstance(kernel, BlockedExperts) == blocked
    want = fused_moe_ref(x, w["w13"].to(dtype), w["w2"].to(dtype), weights, ids,
                         expert_start=start, **oai(w, dtype))
    close(kernel(x, weights, ids, start), want, TOL[dtype] if blocked else 5e-2, dtype)


@needs_blocked
@pytest.mark.parametrize("biases,activation", [(True, "swigluoai"), (False, "swigluoai"),
                                               (True, "silu")])
def test_fused_c_experts_match_the_per_expert_path(biases, activation):
    """One C call against the per-expert path (the same packed linears with the experts' bias
    rows, swigluoai_and_mul.c between): the same bits, on 1 and 2 threads."""
    w = de_interleaved(checkpoint(seed=5))
    variant = {"activation": activation, "swiglu_alpha": 1.5, "swiglu_limit": 5.0}
    if biases:
        variant |= {"w13_bias": w["w13_bias"], "w2_bias": w["w2_bias"]}
    kernel = get_backend("cpu").prepare_experts(w["w13"], w["w2"], torch.bfloat16, **variant)
    assert isinstance(kernel, BlockedExperts)
    v = kernel.variant
    act = (functools.partial(swigluoai_and_mul_cpu, alpha=1.5, limit=5.0)
           if activation == "swigluoai" else silu_and_mul_cpu)
    per_expert = LinearExperts(kernel.w13, kernel.w2, H, act, v.w13_bias, v.w2_bias)
    weights, ids = routing(64, 4, E + 4)  # some ids on another rank (expert_start 2)
    x = torch.randn(64, H).bfloat16()
    want = per_expert(x, weights, ids, 2)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(kernel(x, weights, ids, 2), want)
    finally:
        torch.set_num_threads(threads)
    ref = fused_moe_ref(x, w["w13"].bfloat16(), w["w2"].bfloat16(), weights, ids,
                        expert_start=2, **{k: (t.bfloat16() if isinstance(t, torch.Tensor)
                                               else t) for k, t in variant.items()})
    close(want, ref, 5e-2, torch.bfloat16)


def quantized(w: dict[str, torch.Tensor], bits: int, group: int):
    return ([quantize(t, bits, group) for t in w["w13"]],
            [quantize(t, bits, group) for t in w["w2"]])


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 0)])
def test_quantized_experts_with_biases(bits, group):
    """The reference against the loop on the dequantized weights; the CPU's and the Triton
    backend's quantized experts (biases into their quantized linears) against the reference."""
    w = de_interleaved(checkpoint(seed=6))
    w13, w2 = quantized(w, bits, group)
    weights, _ = routing(4, 2, E)
    ids = torch.tensor([[2, 3], [3, 0], [2, 11], [0, 3]])  # local 0 and 1 (start 2), others'
    x = torch.randn(4, H)
    want = fused_moe_ref(x, w13, w2, weights, ids, expert_start=2, **oai(w))
    deq = interleaved({"w13": torch.stack([dequantize(q) for q in w13]),
                       "w2": torch.stack([dequantize(q) for q in w2]),
                       "w13_bias": w["w13_bias"], "w2_bias": w["w2_bias"]})
    close(want, gpt_oss_experts(x, deq, ids, weights, 2), 1e-5, torch.float32)
    prepared = {  # Triton: stacked for the grouped GEMMs; the CPU: one linear an expert
        "triton": lambda k: isinstance(k, triton_moe.TritonExperts)
        and isinstance(k.w13, triton_moe.StackedQuantized) and k.variant.w13_bias is not None,
        "cpu": lambda k: isinstance(k, LinearExperts) and k.w13_bias is not None}
    for name in ["triton"] + (["cpu"] if CpuBackend.available() else []):
        kernel = get_backend("cpu", name).prepare_experts(w13, w2, torch.float32, **oai(w))
        assert prepared[name](kernel)
        close(kernel(x, weights, ids, 2), want, 1e-5, torch.float32)


TRITON_SHAPE = (8, 48, 40)  # (E, H, INTER): tiles that end inside their blocks (masked)


@pytest.mark.parametrize("dtype,tokens", [(torch.float32, 5), (torch.float32, 40),
                                          (torch.bfloat16, 5)])
@pytest.mark.parametrize("biases,activation", [(True, "swigluoai"), (False, "swigluoai"),
                                               (True, "silu")])
def test_triton_experts_match_the_reference(dtype, tokens, biases, activation):
    num_experts, hidden, inter = TRITON_SHAPE
    w = de_interleaved(checkpoint(num_experts, hidden, inter, seed=7))
    variant = {"activation": activation, "swiglu_alpha": 1.702, "swiglu_limit": 7.0}
    if biases:
        variant |= {"w13_bias": w["w13_bias"].to(dtype), "w2_bias": w["w2_bias"].to(dtype)}
    weights, ids = routing(tokens, 4, num_experts + 4)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    w13, w2 = w["w13"].to(dtype), w["w2"].to(dtype)
    got = fused_moe(x, w13, w2, weights, ids, expert_start=2, **variant)
    want = fused_moe_ref(x, w13, w2, weights, ids, expert_start=2, **variant)
    close(got, want, TOL[dtype] if dtype == torch.float32 else 5e-2, dtype)


def test_backends_prepare_the_variant():
    w = de_interleaved(checkpoint(seed=8))
    kernel = get_backend("cpu", "torch").prepare_experts(w["w13"], w["w2"], torch.bfloat16,
                                                         **oai(w))
    assert isinstance(kernel, ExpertsRef) and kernel.variant.w2_bias.dtype == torch.bfloat16
    assert sum(t.numel() for t in kernel.tensors) == sum(t.numel() for t in w.values())
    plain = get_backend("cpu", "torch").prepare_experts(w["w13"], w["w2"], torch.float32)
    assert plain.variant.activation == "silu" and len(plain.tensors) == 2


@pytest.mark.parametrize("change,match", [
    ({"activation": "gelu"}, "activation must be one of"),
    ({"swiglu_limit": float("inf")}, "swiglu_limit"),
    ({"w13_bias": torch.zeros(E, INTER)}, "w13_bias must have shape"),
    ({"w2_bias": torch.zeros(E, H, dtype=torch.int32)}, "w2_bias must have dtype"),
])
def test_bad_variants_name_the_fix(change, match):
    w = de_interleaved(checkpoint(seed=9))
    weights, ids = routing(3, 2, E)
    kwargs = oai(w) | change
    for name in ("torch", "triton"):
        with pytest.raises(ValueError, match=match):
            get_backend("cpu", name).prepare_experts(w["w13"], w["w2"], torch.float32, **kwargs)
    with pytest.raises(ValueError, match=match):
        fused_moe_ref(torch.randn(3, H), w["w13"], w["w2"], weights, ids, **kwargs)
