"""Quantized checkpoint weights land in each TP rank's slice as the dense ones do."""

from __future__ import annotations

import torch

from pdserve.engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    prepare_weights,
)
from pdserve.kernels.backend import get_backend
from pdserve.kernels.quant_weights import dequantize, quantize
from pdserve.kernels.reference.linear import QuantLinearRef

RANK_1_OF_2 = TensorParallel(rank=1, size=2, group=object())  # loading runs no collective
KW = {"dtype": torch.float32, "device": torch.device("cpu")}


def weight(out: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(out, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_embedding_rows_of_rank_1_from_a_quantized_table():
    q = quantize(weight(40, 64, 0), 8, 32)  # GGUF's token_embd is Q8_0
    emb = VocabParallelEmbedding(40, 64, RANK_1_OF_2, **KW)
    emb.load("weight", q)
    assert torch.equal(emb.weight.data, dequantize(q)[20:])


def test_fused_column_and_row_shards_of_rank_1():
    gate, up, down = (quantize(weight(64, 64, s), 4, 32) for s in (1, 2, 3))
    col = ColumnParallelLinear(64, {"gate": 64, "up": 64}, False, RANK_1_OF_2, **KW)
    col.load("weight", gate, "gate")
    col.load("weight", up, "up")
    row = RowParallelLinear(64, 64, RANK_1_OF_2, **KW)
    row.load("weight", down)
    assert torch.equal(dequantize(col.quantized),
                       torch.cat([dequantize(gate)[32:], dequantize(up)[32:]]))
    assert torch.equal(dequantize(row.quantized), dequantize(down)[:, 32:])
    assert col.weight is None and row.weight is None


def test_the_torch_backend_keeps_the_layout_and_runs_the_reference():
    layer = RowParallelLinear(64, 16, TensorParallel(), **KW)
    q = quantize(weight(16, 64, 4), 4, 32)
    layer.load("weight", q)
    prepare_weights(layer, get_backend("cpu", "torch"), torch.float32)
    x = torch.randn(3, 64)
    assert isinstance(layer.kernel, QuantLinearRef) and layer.kernel.weight.shape == (16, 64)
    torch.testing.assert_close(layer(x), x @ dequantize(q).t())
