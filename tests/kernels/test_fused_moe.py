"""The MoE experts' op: `fused_moe_ref` against a per-token loop in float64 (the oracle written
here), then the CPU backend's experts and the Triton grouped GEMM (interpreter) against it.

Routings (`CASES`): top-1, top-2 and top-8; expert parallelism (expert_start 2, with ids of other
ranks' experts below and above the local range); every token to one expert (three 16-row
blocks of it in the Triton kernel); experts that receive no tokens; one token; 40 tokens
of top-4 (64-row blocks).

The CPU's bf16 experts in one C call (`fused_moe.c`, `C_CASES`: 1, 3 and 64 tokens of top-1,
top-2 and top-8, expert parallelism, one expert's 130 rows in two row blocks, idle experts, on
a shape of several column tiles) are held bit for bit to the per-expert path they replace
(the same packed linears and SiLU * up kernel, on 1 and 2 threads, int64 and int32 ids), and
to the reference and the oracle within the bf16 tolerance below.

Tolerances, as torch.testing.assert_close's atol = rtol (|got - want| <= tol * (1 + |want|)),
outputs of magnitude up to ~4 (weights scaled by 1/sqrt(fan-in)):
- fp32: 1e-5 (seen: 8e-7; fp32 GEMM sums in other orders), quantized experts alike (the
  reference dequantizes in fp32; the CPU's int4/int8 ops in fp32 agree to fp32 rounding).
- bf16, against the float64 oracle on the same bf16 inputs or against the bf16 reference: 3e-2
  (seen: 1.3e-2, about one bf16 step at |want| ~ 2). Each GEMM's output, SiLU * up and the
  result are rounded to bf16 (2^-9 relative each); the Triton kernel keeps gate and up in
  fp32 and rounds each slot's output before the sum (the interpreter truncating its final
  cast); the CPU's int4/int8 ops take their scales rounded to bf16 (seen: 1e-2). A lost
  expert or a wrong routing weight moves outputs by 0.1 or more, and the fp32 cases hold
  every path to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.backend import get_backend
from pdserve.kernels.cpu import packed_linear
from pdserve.kernels.cpu.backend import CpuBackend
from pdserve.kernels.cpu.fused_moe import BlockedExperts
from pdserve.kernels.cpu.packed_linear import BlockedLinear, OneDnnLinear
from pdserve.kernels.cpu.silu_and_mul import silu_and_mul_cpu
from pdserve.kernels.quant_weights import QuantizedWeight, dequantize, quantize
from pdserve.kernels.reference.fused_moe import (
    ExpertsRef,
    LinearExperts,
    fused_moe_ref,
    moe_align,
)
from pdserve.kernels.triton import fused_moe as triton_moe  # its classes, unswapped in GPU mode
from pdserve.kernels.triton.fused_moe import fused_moe

E, H, INTER = 8, 128, 64  # multiples of the CPU's 64-column tiles: bf16 runs the packed kernel
TRITON_SHAPE = (8, 48, 40)  # (E, H, INTER): tiles that end inside their blocks (masked)
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}

# name: (tokens, top_k, expert_start, pool of global ids or None for the local range)
CASES = {
    "top1": (7, 1, 0, None),
    "top2": (7, 2, 0, None),
    "top8": (5, 8, 0, None),
    "expert_parallel": (9, 3, 2, "wide"),  # ids 0..E+3: two below the local range, two above
    "one_expert": (40, 1, 0, [3]),
    "idle_experts": (9, 2, 0, [1, 4]),
    "one_token": (1, 2, 0, None),
    "prefill": (40, 4, 0, None),  # 160 pairs: the Triton kernel's 64-row blocks
}
# The C call's routings (same fields), on C_SHAPE: w2's 192 output columns are 3 work items
# of 64 columns, the 128 act columns 2 (each both a gate and an up tile); 96-row blocks.
C_SHAPE = (8, 192, 128)  # (E, H, INTER)
C_CASES = {
    "t1_top1": (1, 1, 0, None),
    "t1_top8": (1, 8, 0, None),
    "t3_top2": (3, 2, 0, None),
    "t3_top8": (3, 8, 0, None),
    "t64_top1": (64, 1, 0, None),
    "t64_top2": (64, 2, 0, None),
    "t64_top8": (64, 8, 0, None),  # every expert 64 rows
    "t64_expert_parallel": (64, 3, 2, "wide"),
    "t130_one_expert": (130, 1, 0, [3]),  # two row blocks (96 + 34) of one expert
    "t64_idle_experts": (64, 2, 0, [1, 4]),
}
needs_cpu = pytest.mark.skipif(not CpuBackend.available(), reason="no C compiler: no cpu backend")
needs_blocked = pytest.mark.skipif(
    not CpuBackend.available() or not packed_linear.blocked_available(),
    reason="neither AVX512-BF16 nor AVX2 here: bf16 experts keep oneDNN's per-expert path")


def routing(case: str, num_experts: int, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(topk_weights [T, k] fp32, topk_ids [T, k] int64, expert_start): distinct ids per token."""
    tokens, top_k, start, pool = CASES[case] if case in CASES else C_CASES[case]
    if pool is None:
        pool = range(start, start + num_experts)
    elif pool == "wide":
        pool = range(0, start + num_experts + 2)
    g = torch.Generator().manual_seed(seed)
    pick = torch.rand(tokens, len(pool), generator=g).argsort(-1)[:, :top_k]
    ids = torch.tensor(list(pool))[pick]
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids, start


def dense_experts(num_experts: int, hidden: int, inter: int, seed: int = 1
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [64, H], w13 [E, 2I, H], w2 [E, H, I]) fp32; take x[:T]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    return x, w13, w2


def naive_moe(x, w13, w2, topk_weights, topk_ids, expert_start=0):
    """Token by token, slot by slot, in float64: the oracle. Quantized experts dequantized."""
    if not isinstance(w13, torch.Tensor):
        w13 = torch.stack([dequantize(w) for w in w13])
        w2 = torch.stack([dequantize(w) for w in w2])
    w13, w2, x = w13.double(), w2.double(), x.double()
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j]) - expert_start
            if not 0 <= e < w13.shape[0]:
                continue
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            out[t] += float(topk_weights[t, j]) * (w2[e] @ (F.silu(gate) * up))
    return out


def close(got: torch.Tensor, want: torch.Tensor, tol: float, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_the_per_token_loop(case, dtype):
    weights, ids, start = routing(case, E)
    x, w13, w2 = dense_experts(E, H, INTER)
    x, w13, w2 = x[:ids.shape[0]].to(dtype), w13.to(dtype), w2.to(dtype)
    got = fused_moe_ref(x, w13, w2, weights, ids, expert_start=start)
    close(got, naive_moe(x, w13, w2, weights, ids, start), TOL[dtype], dtype)


def test_ids_outside_the_local_range_add_nothing():
    weights, ids, _ = routing("top2", E)
    x, w13, w2 = dense_experts(E, H, INTER)
    out = fused_moe_ref(x[:7], w13, w2, weights, ids, expert_start=E)  # all on another rank
    assert torch.equal(out, torch.zeros(7, H))
    # two ranks' partial outputs sum to the whole layer's (expert parallelism)
    halves = [fused_moe_ref(x[:7], w13[s:s + E // 2], w2[s:s + E // 2], weights, ids,
                            expert_start=s) for s in (0, E // 2)]
    whole = fused_moe_ref(x[:7], w13, w2, weights, ids)
    torch.testing.assert_close(halves[0] + halves[1], whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", ["top2", "expert_parallel", "one_expert", "idle_experts"])
def test_moe_align_pads_each_expert_to_whole_blocks(case):
    weights, ids, start = routing(case, E)
    align = moe_align(ids, E, 16, start)
    num_pairs = ids.numel()
    local = ids.flatten() - start
    sorted_ids = align.sorted_ids.view(-1, 16)
    seen = []
    for block, expert in zip(sorted_ids, align.block_experts.tolist(), strict=True):
        pairs = block[block < num_pairs]
        if expert < 0:
            assert pairs.numel() == 0
            continue
        assert pairs.numel() > 0 and (local[pairs] == expert).all()
        seen += pairs.tolist()
    in_range = ((local >= 0) & (local < E)).nonzero().flatten().tolist()
    assert sorted(seen) == in_range  # each local pair exactly once, no other rank's
    experts = [e for e in align.block_experts.tolist() if e >= 0]
    assert experts == sorted(experts)  # blocks ascend by expert, used blocks first
    assert (align.block_experts[len(experts):] == -1).all()


@needs_cpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_experts_match_the_reference(case, dtype):
    weights, ids, start = routing(case, E)
    x, w13, w2 = dense_experts(E, H, INTER)
    x = x[:ids.shape[0]].to(dtype)
    kernel = get_backend("cpu").prepare_experts(w13, w2, dtype)
    if dtype == torch.bfloat16 and packed_linear.can_pack(w13[0].to(dtype)):
        assert all(isinstance(k, BlockedLinear | OneDnnLinear) for k in kernel.w13 + kernel.w2)
    # bf16 packed for linear_bf16.c runs as one C call; everything else per expert
    blocked = dtype == torch.bfloat16 and packed_linear.blocked_available()
    assert isinstance(kernel, BlockedExperts) == blocked
    want = fused_moe_ref(x, w13.to(dtype), w2.to(dtype), weights, ids, expert_start=start)
    close(kernel(x, weights, ids, start), want, TOL[dtype], dtype)


def fused_c_experts(seed: int = 1) -> tuple[BlockedExperts, torch.Tensor, torch.Tensor]:
    """(the CPU backend's bf16 experts of C_SHAPE, w13, w2 fp32 as drawn)."""
    _, w13, w2 = dense_experts(*C_SHAPE, seed=seed)
    kernel = get_backend("cpu").prepare_experts(w13, w2, torch.bfloat16)
    assert isinstance(kernel, BlockedExperts)
    return kernel, w13, w2


@needs_blocked
@pytest.mark.parametrize("case", C_CASES)
def test_fused_c_experts_match_the_per_expert_path(case):
    num_experts, hidden, inter = C_SHAPE
    weights, ids, start = routing(case, num_experts)
    kernel, w13, w2 = fused_c_experts()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(ids.shape[0], hidden, generator=g).bfloat16()
    per_expert = LinearExperts(kernel.w13, kernel.w2, hidden, silu_and_mul_cpu)
    want = per_expert(x, weights, ids, start)
    for threads in (1, 2):  # items spread over threads that wait only for what they read
        torch.set_num_threads(threads)
        got = kernel(x, weights, ids, start)
        assert torch.equal(got, want)
        assert torch.equal(kernel(x, weights, ids.int(), start), want)
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    close(got, fused_moe_ref(x, w13, w2, weights, ids, expert_start=start),
          TOL[torch.bfloat16], torch.bfloat16)
    close(got, naive_moe(x, w13, w2, weights, ids, start), TOL[torch.bfloat16], torch.bfloat16)


@needs_blocked
def test_fused_c_experts_drop_other_ranks_ids():
    kernel, _, _ = fused_c_experts()
    weights, ids, _ = routing("t3_top2", C_SHAPE[0])
    x = torch.randn(3, C_SHAPE[1]).bfloat16()
    for start in (C_SHAPE[0], -C_SHAPE[0]):  # every id above, then below, the local range
        assert torch.equal(kernel(x, weights, ids, start), torch.zeros_like(x))
    assert kernel(x[:0], weights[:0], ids[:0]).shape == (0, C_SHAPE[1])
    with pytest.raises(ValueError, match="bfloat16"):
        kernel(x.float(), weights, ids)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_the_reference(case, dtype):
    num_experts, hidden, inter = TRITON_SHAPE
    weights, ids, start = routing(case, num_experts)
    x, w13, w2 = dense_experts(num_experts, hidden, inter)
    x, w13, w2 = x[:ids.shape[0]].to(dtype), w13.to(dtype), w2.to(dtype)
    got = fused_moe(x, w13, w2, weights, ids, expert_start=start)
    assert not torch.isnan(got).any()  # every slot it keeps was written (poisoned outputs)
    want = fused_moe_ref(x, w13, w2, weights, ids, expert_start=start)
    close(got, want, TOL[dtype], dtype)


def quantized_experts(bits: int, group: int) -> tuple[list[QuantizedWeight], ...]:
    _, w13, w2 = dense_experts(E, H, INTER)
    return ([quantize(w, bits, group) for w in w13], [quantize(w, bits, group) for w in w2])


QUANT = [(4, 32), (8, 0), (8, 32)]  # int4 g32, int8 per channel, int8 g32 (CPU: reference)


@pytest.mark.parametrize("bits,group", QUANT)
def test_quantized_reference_matches_the_loop(bits, group):
    weights, ids, start = routing("expert_parallel", E)
    w13, w2 = quantized_experts(bits, group)
    x = dense_experts(E, H, INTER)[0][:ids.shape[0]]
    got = fused_moe_ref(x, w13, w2, weights, ids, expert_start=start)
    close(got, naive_moe(x, w13, w2, weights, ids, start), TOL[torch.float32], torch.float32)


@needs_cpu
@pytest.mark.parametrize("bits,group", QUANT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_cpu_experts_match_the_reference(bits, group, dtype):
    weights, ids, start = routing("top2", E)
    w13, w2 = quantized_experts(bits, group)
    x = dense_experts(E, H, INTER)[0][:ids.shape[0]].to(dtype)
    kernel = get_backend("cpu").prepare_experts(w13, w2, dtype)
    want = fused_moe_ref(x, w13, w2, weights, ids, expert_start=start)
    close(kernel(x, weights, ids, start), want, TOL[dtype], dtype)


@pytest.mark.parametrize("bits,group,dtype", [(4, 32, torch.float32), (8, 0, torch.float32),
                                              (4, 32, torch.bfloat16)])
def test_quantized_triton_experts_match_the_reference(bits, group, dtype):
    """Quantized experts stack into the grouped GEMMs (no host sync: CUDA graphs capture
    them), whose tiles are the quantized linear kernel's."""
    weights, ids, start = routing("idle_experts", E)  # two experts: four interpreted launches
    w13, w2 = quantized_experts(bits, group)
    x = dense_experts(E, H, INTER)[0][:ids.shape[0]].to(dtype)
    kernel = get_backend("cpu", "triton").prepare_experts(w13, w2, dtype)
    assert isinstance(kernel, triton_moe.TritonExperts)
    assert isinstance(kernel.w13, triton_moe.StackedQuantized)
    assert kernel.w13.shape == (E, 2 * INTER, H) and kernel.w2.shape == (E, H, INTER)
    want = fused_moe_ref(x, w13, w2, weights, ids, expert_start=start)
    close(kernel(x, weights, ids, start), want, TOL[dtype], dtype)


def test_quantized_experts_that_do_not_stack_run_one_expert_at_a_time():
    """Groups the kernel does not take, or experts of mixed widths: `LinearExperts`, equal to
    the reference all the same."""
    weights, ids, start = routing("idle_experts", E)
    _, dense13, dense2 = dense_experts(E, H, INTER)
    x = dense_experts(E, H, INTER)[0][:ids.shape[0]]
    mixed = ([quantize(w, 8 if e % 2 else 4, 32) for e, w in enumerate(dense13)],
             [quantize(w, 8, 32) for w in dense2])
    small = ([quantize(w, 8, 8) for w in dense13], [quantize(w, 8, 8) for w in dense2])
    for w13, w2 in (mixed, small):
        kernel = get_backend("cpu", "triton").prepare_experts(w13, w2, torch.float32)
        assert isinstance(kernel, LinearExperts)
        want = fused_moe_ref(x, w13, w2, weights, ids, expert_start=start)
        close(kernel(x, weights, ids, start), want, TOL[torch.float32], torch.float32)


def test_torch_backend_prepares_the_reference():
    weights, ids, _ = routing("top2", E)
    x, w13, w2 = dense_experts(E, H, INTER)
    kernel = get_backend("cpu", "torch").prepare_experts(w13, w2, torch.bfloat16)
    assert isinstance(kernel, ExpertsRef) and kernel.w13.dtype == torch.bfloat16
    assert sum(t.numel() for t in kernel.tensors) == w13.numel() + w2.numel()
    x = x[:7].bfloat16()
    assert torch.equal(kernel(x, weights, ids), fused_moe_ref(x, kernel.w13, kernel.w2,
                                                              weights, ids))


@pytest.mark.parametrize("change,match", [
    ({"w2": torch.zeros(E, H, INTER + 1)}, "w2"),
    ({"topk_weights": torch.ones(7, 2, dtype=torch.bfloat16)}, "topk_weights"),
    ({"topk_ids": torch.zeros(7, 2)}, "topk_ids"),
    ({"x": torch.zeros(7, H + 1)}, "x"),
    ({"w13": torch.zeros(E, 2 * INTER, H, dtype=torch.bfloat16)}, "w13"),
])
def test_bad_arguments_name_the_fix(change, match):
    weights, ids, _ = routing("top2", E)
    x, w13, w2 = dense_experts(E, H, INTER)
    args = {"x": x[:7], "w13": w13, "w2": w2, "topk_weights": weights, "topk_ids": ids}
    args |= change
    for op in (fused_moe_ref, fused_moe):
        with pytest.raises(ValueError, match=match):
            op(*args.values())
