"""Linears on weights packed once (kernels.cpu.packed_linear: the blocked kernel, on AVX512-BF16 or
AVX2, or oneDNN's layout) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from paged_case import rel_err

from pdserve import LLM, SamplingParams
from pdserve.engine.models.parallel import ParallelLinear
from pdserve.kernels.cpu import packed_linear
from pdserve.kernels.reference.linear import DenseLinear

blocked = pytest.mark.skipif(not packed_linear.blocked_available(),
                             reason="this CPU has neither AVX512-BF16 nor AVX2: no blocked kernel")
onednn_bf16 = packed_linear.onednn_bf16()


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 32, 96, 97, 300])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_features", [192, 200], ids=["tiled", "untiled"])
@pytest.mark.parametrize("in_features", [80, 128])
def test_packed_matches_f_linear(rows, with_bias, out_features, in_features):
    """192 output columns tile by 64 and by 16: the blocked kernel where the CPU runs it (tiles
    of 64 with AVX512-BF16, 16 with AVX2); 200 tile by neither: oneDNN's layout where oneDNN
    has bf16 kernels, else the plain weight (F.linear). The blocked kernel also agrees closely
    with oneDNN on the same weight (both sum in fp32 and round once). On a CPU with AMX, 128
    inputs (a multiple of 32) send each whole 16 rows through the tile unit, the rest (and
    every row of 80 inputs) through the AVX512-BF16 tiles."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    cols = packed_linear.tile_cols()
    blocked = bool(cols) and out_features % cols == 0
    assert packed_linear.can_pack(w) == (blocked or onednn_bf16)
    kernel = packed_linear.pack(w) if blocked or onednn_bf16 else DenseLinear(w)
    if blocked:
        assert kernel.packed.shape == (out_features // cols, in_features // 2, cols, 2)
    else:
        assert isinstance(kernel, packed_linear.OneDnnLinear if onednn_bf16 else DenseLinear)
    out = kernel(x, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    assert rel_err(out, F.linear(x.float(), w.float(), None if b is None else b.float())) < 1e-2
    if blocked and onednn_bf16:
        onednn = packed_linear.OneDnnLinear(torch.ops.mkldnn._reorder_linear_weight(w, 32))
        assert rel_err(out, onednn(x, b)) < 5e-3


@blocked
def test_amx_is_used_where_the_cpu_has_it():
    """A CPU whose flags list AMX's tiles and bf16 sends 2 rows or more through them (the
    kernel is built for this CPU, and Linux lends the tile registers); no other CPU does."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    assert packed_linear.amx() == ("amx_tile" in flags and "amx_bf16" in flags)


@blocked
def test_blocked_takes_any_leading_dims_and_no_rows():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=gen).bfloat16()
    kernel = packed_linear.pack(w)
    x = torch.randn(2, 3, 32, generator=gen).bfloat16()[:, ::2]  # strided
    out = kernel(x)
    assert out.shape == (2, 2, 64)
    assert rel_err(out, F.linear(x.float(), w.float())) < 1e-2
    assert kernel(x[:0]).shape == (0, 2, 64)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        kernel(x.float())
    with pytest.raises(ValueError, match="bias must be"):
        kernel(x, torch.zeros(63, dtype=torch.bfloat16))


def test_fp32_is_never_packed():
    """fp32 stays on F.linear: the path that is token-identical to transformers."""
    assert not packed_linear.can_pack(torch.randn(4, 4))


def test_the_cpu_backend_packs_bf16_models(tiny_llama_dir):
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [40, 41, 42]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(model=str(tiny_llama_dir), dtype="bfloat16", num_threads=2, num_kv_blocks=16,
                  max_model_len=256, kernel_backend=backend)
        model = llm.engine.core.runner.model
        kernels = [m.kernel for m in model.modules() if isinstance(m, ParallelLinear)]
        assert all(isinstance(k, DenseLinear) != (backend == "cpu") for k in kernels)
        packed = [k.packed for k in kernels if isinstance(k, packed_linear.BlockedLinear)]
        assert len({p.untyped_storage().data_ptr() for p in packed}) == (1 if packed else 0)
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["cpu"] == outputs["torch"]
