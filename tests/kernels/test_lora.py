"""Batched multi-LoRA (shrink, expand, `add_lora`): the torch reference, the C kernels
(`kernels/cpu/lora.c`) and the Triton kernels (interpreted) against a per-token loop in
float64 written here, on random adapters: slot runs with -1 between them, a prefill-like long
segment, decode-like segments of one token, 1, 2 and 3 slices of odd widths, ranks that are
and are not multiples of 16.

Tolerances: shrink sums fp32 products in fp32 in both dtypes (bf16 products are exact in
fp32): 1e-5 relative. Expand in fp32: 1e-5 relative; in bf16, y is rounded once: one bf16 step
(2^-7 relative; the interpreter truncates where the others round). Tokens of slot -1 are
exactly 0 in buf and exactly untouched in y.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kernels.backend import BACKENDS, get_backend
from pdserve.kernels.cpu.lora import lora_expand_cpu, lora_shrink_cpu
from pdserve.kernels.lora_mapping import lora_mapping
from pdserve.kernels.reference.lora import lora_expand_ref, lora_shrink_ref
from pdserve.kernels.triton.lora import lora_expand, lora_shrink

ROOMS = ("torch", "cpu", "triton")
PATTERNS = {  # each token's slot; -1: no adapter
    "mixed": [0, 0, 0, -1, -1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, -1, 2, 2],
    "prefill": [-1, -1] + [1] * 70 + [0] * 3 + [-1],  # more rows than a 64-row block
    "decode": [3, 1, -1, 0, 2, 1, 3, -1, 0],  # one token per segment
}
SLICES = {1: (0, 29), 2: (0, 24, 37), 3: (0, 20, 33, 57)}  # widths not multiples of 16
NUM_SLOTS, DIM = 4, 40


def kernels(room: str):
    """A room's (shrink, expand), looked up at the call: GPU mode swaps the Triton ones."""
    return {"torch": (lora_shrink_ref, lora_expand_ref), "cpu": (lora_shrink_cpu, lora_expand_cpu),
            "triton": (lora_shrink, lora_expand)}[room]

def random_case(slots: list[int], offsets: tuple[int, ...], rank: int, dtype: torch.dtype,
                dim: int = DIM, seed: int = 0):
    """x [T, dim], a [slots, n * rank, dim], b [slots, out, rank], y [T, out]."""
    gen = torch.Generator().manual_seed(seed)
    n, out = len(offsets) - 1, offsets[-1]
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    return (rand(len(slots), dim), rand(NUM_SLOTS, n * rank, dim), rand(NUM_SLOTS, out, rank),
            rand(len(slots), out))


def shrink_oracle(x: torch.Tensor, a: torch.Tensor, slots: list[int]) -> torch.Tensor:
    buf = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(slots):
        if slot >= 0:
            buf[t] = a[slot].double() @ x[t].double()
    return buf


def expand_oracle(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, slots: list[int],
                  offsets: tuple[int, ...]) -> torch.Tensor:
    """y + the adapters' outputs, in float64 (unrounded)."""
    want, rank = y.double(), b.shape[2]
    for t, slot in enumerate(slots):
        for s in range(len(offsets) - 1 if slot >= 0 else 0):
            lo, hi = offsets[s], offsets[s + 1]
            want[t, lo:hi] += b[slot, lo:hi].double() @ buf[t, s * rank:(s + 1) * rank].double()
    return want


def assert_expanded(got: torch.Tensor, y: torch.Tensor, want: torch.Tensor, slots: list[int]):
    none = torch.tensor(slots) < 0
    assert torch.equal(got[none], y[none])  # untouched, bit for bit
    tol = dict(rtol=1e-5, atol=1e-4) if y.dtype == torch.float32 else dict(rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(got.double(), want, **tol)
    assert not torch.equal(got[~none], y[~none])  # the adapters added something


@pytest.mark.parametrize("room", ROOMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("rank", [16, 8])
def test_shrink(room, dtype, pattern, rank):
    slots = PATTERNS[pattern]
    x, a, _, _ = random_case(slots, SLICES[3], rank, dtype)
    buf = kernels(room)[0](x, a, lora_mapping(np.array(slots), torch.device("cpu")))
    assert buf.dtype == torch.float32 and buf.shape == (len(slots), 3 * rank)
    assert (buf[torch.tensor(slots) < 0] == 0).all()
    torch.testing.assert_close(buf.double(), shrink_oracle(x, a, slots), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("room", ROOMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(("num_slices", "rank"), [(1, 16), (2, 8), (3, 16), (3, 20)])
def test_expand(room, dtype, pattern, num_slices, rank):
    slots, offsets = PATTERNS[pattern], SLICES[num_slices]
    _, _, b, y = random_case(slots, offsets, rank, dtype, seed=1)
    buf = torch.randn(len(slots), num_slices * rank, generator=torch.Generator().manual_seed(2))
    got = y.clone()
    kernels(room)[1](got, buf, b, lora_mapping(np.array(slots), torch.device("cpu")), offsets)
    assert_expanded(got, y, expand_oracle(y, buf, b, slots, offsets), slots)


@pytest.mark.parametrize("room", ROOMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wider_than_one_block(room, dtype):
    """in, R and a slice each span several of the Triton kernels' 64-wide blocks (and the C
    kernels' 16-wide chunks, with tails)."""
    slots, offsets = PATTERNS["mixed"], (0, 80, 101, 150)
    x, a, b, y = random_case(slots, offsets, 32, dtype, dim=136, seed=5)
    shrink, expand = kernels(room)
    mapping = lora_mapping(np.array(slots), torch.device("cpu"))
    buf = shrink(x, a, mapping)
    torch.testing.assert_close(buf.double(), shrink_oracle(x, a, slots), rtol=1e-5, atol=1e-4)
    got = y.clone()
    expand(got, buf, b, mapping, offsets)
    assert_expanded(got, y, expand_oracle(y, buf, b, slots, offsets), slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [16, 24])
def test_cpu_many_segments_on_two_threads(dtype, rank):
    """Enough work for the C kernels' parallel path: segments of 1..37 rows (item blocks of 8
    and their tails), the slot runs in any order, wider rows (x rows of 16-element chunks and
    a tail)."""
    gen = np.random.default_rng(rank)
    slots = [int(s) for n in gen.integers(1, 38, 14) for s in [gen.integers(-1, NUM_SLOTS)] * n]
    offsets = (0, 64, 96, 131)
    x, a, b, y = random_case(slots, offsets, rank, dtype, dim=100, seed=3)
    mapping = lora_mapping(np.array(slots), torch.device("cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        buf = lora_shrink_cpu(x, a, mapping)
        got = y.clone()
        lora_expand_cpu(got, buf, b, mapping, offsets)
    finally:
        torch.set_num_threads(threads)
    want_buf = shrink_oracle(x, a, slots)
    torch.testing.assert_close(buf.double(), want_buf, rtol=1e-5, atol=1e-4)
    assert_expanded(got, y, expand_oracle(y, buf, b, slots, offsets), slots)


def test_cpu_hands_other_layouts_to_the_reference():
    """fp16, a strided x and mismatched dtypes take the reference: the same results."""
    slots = PATTERNS["mixed"]
    mapping = lora_mapping(np.array(slots), torch.device("cpu"))
    x, a, b, y = random_case(slots, SLICES[2], 8, torch.float16)
    torch.testing.assert_close(lora_shrink_cpu(x, a, mapping), lora_shrink_ref(x, a, mapping))
    wide = torch.cat([x.float(), x.float()], dim=1)[:, ::2]  # not contiguous
    torch.testing.assert_close(lora_shrink_cpu(wide, a.float(), mapping),
                               lora_shrink_ref(wide, a.float(), mapping))
    buf = lora_shrink_ref(x, a, mapping)
    got, want = y.float(), y.float()
    lora_expand_cpu(got, buf, b, mapping, SLICES[2])  # b fp16, y fp32
    lora_expand_ref(want, buf, b, mapping, SLICES[2])
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_lora_on_every_backend(backend, dtype):
    """The op the model calls: shrink then expand, on each backend's own kernels."""
    slots, offsets = PATTERNS["mixed"], SLICES[3]
    x, a, b, y = random_case(slots, offsets, 16, dtype, seed=4)
    got = y.clone()
    mapping = lora_mapping(np.array(slots), torch.device("cpu"))
    get_backend("cpu", backend).add_lora(got, x, a, b, mapping, offsets)
    want = expand_oracle(y, shrink_oracle(x, a, slots), b, slots, offsets)
    assert_expanded(got, y, want, slots)


def test_triton_checks_its_arguments():
    slots = PATTERNS["decode"]
    mapping = lora_mapping(np.array(slots), torch.device("cpu"))
    x, a, b, y = random_case(slots, SLICES[2], 8, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        lora_shrink(x, a.bfloat16(), mapping)
    with pytest.raises(ValueError, match="slots"):
        lora_shrink(x, a[:2], mapping)
    buf = lora_shrink(x, a, mapping)
    with pytest.raises(ValueError, match="slice offsets"):
        lora_expand(y, buf, b, mapping, (0, 37, 37))
