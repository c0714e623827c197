"""The int8/int4 layouts: round-trip bounds, exactness on the grid, shards and fused rows."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.quant_weights import (
    QuantizedWeight,
    cat_rows,
    dequantize,
    pack_int4,
    quantize,
    unpack_int4,
)


def weights(out=48, cols=128, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, cols, generator=g) * 0.05 + 0.01


def per_element(values: torch.Tensor, group_size: int) -> torch.Tensor:
    return values.repeat_interleave(group_size, dim=1)


@pytest.mark.parametrize("bits,group_size", [(8, 0), (8, 32), (4, 32), (4, 64), (4, 128)])
def test_round_trip_is_within_half_a_step(bits, group_size):
    w = weights()
    q = quantize(w, bits, group_size)
    step = per_element(q.scales, q.group_size)
    error = (dequantize(q) - w).abs()
    assert torch.all(error <= step / 2 * (1 + 1e-5) + 1e-7)
    assert q.group_size == (group_size or (32 if bits == 4 else w.shape[1]))


@pytest.mark.parametrize("bits", [4, 8])
def test_values_on_the_grid_come_back_exactly(bits):
    g = torch.Generator().manual_seed(1)
    levels = torch.randint(0, 16, (32, 64), generator=g) if bits == 4 else torch.randint(
        -127, 128, (32, 64), generator=g)
    scale = 2.0 ** -torch.randint(3, 8, (32, 2), generator=g).float()
    if bits == 4:  # each group spans all 16 levels around a 0: w = (q - 7) * scale
        levels[:, [0, 32]], levels[:, [1, 33]] = 0, 15
        w = (levels.float() - 7) * per_element(scale, 32)
    else:  # each group reaches +-127
        levels[:, [0, 32]] = 127
        w = levels.float() * per_element(scale, 32)
    assert torch.equal(dequantize(quantize(w, bits, 32)), w)


def test_nibbles_round_trip_and_pair_low_first():
    q = torch.randint(0, 16, (5, 40), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 20)
    assert torch.equal(unpack_int4(packed), q)
    assert torch.equal(packed[:, 0] & 0xF, q[:, 0]) and torch.equal(packed[:, 0] >> 4, q[:, 1])


@pytest.mark.parametrize("bits,group_size", [(8, 0), (8, 32), (4, 32)])
def test_shards_and_fused_rows_dequantize_to_the_same_slices(bits, group_size):
    w = weights(64, 128)
    q = quantize(w, bits, group_size)
    full = dequantize(q)
    assert torch.equal(dequantize(q.narrow(0, 16, 32)), full[16:48])
    assert torch.equal(dequantize(q.narrow(1, 64, 64)), full[:, 64:])  # a TP-2 column shard
    assert torch.equal(dequantize(cat_rows([q.narrow(0, 0, 8), q.narrow(0, 40, 24)])),
                       torch.cat([full[:8], full[40:]]))


def test_a_column_shard_must_cut_whole_groups():
    q = quantize(weights(8, 128), 4, 64)
    with pytest.raises(ValueError, match="whole groups of 64"):
        q.narrow(1, 32, 64)


def test_nbytes_counts_every_tensor():
    q = quantize(weights(64, 128), 4, 32)
    assert q.nbytes == 64 * 64 + 2 * 64 * 4 * 4
    assert quantize(weights(64, 128), 8).nbytes == 64 * 128 + 64 * 4


@pytest.mark.parametrize("make,match", [
    (lambda: QuantizedWeight(4, 32, torch.zeros(4, 32, dtype=torch.int8),
                             torch.ones(4, 2), torch.zeros(4, 2)), "qweight must be"),
    (lambda: QuantizedWeight(8, 24, torch.zeros(4, 64, dtype=torch.int8),
                             torch.ones(4, 2)), "group_size 24"),
    (lambda: QuantizedWeight(8, 32, torch.zeros(4, 64, dtype=torch.int8),
                             torch.ones(4, 3)), "scales must be"),
    (lambda: QuantizedWeight(4, 32, torch.zeros(4, 32, dtype=torch.uint8),
                             torch.ones(4, 2)), "int4 needs offsets"),
    (lambda: QuantizedWeight(3, 32, torch.zeros(4, 32, dtype=torch.uint8),
                             torch.ones(4, 2)), "bits must be"),
    (lambda: quantize(weights(4, 96), 4, 64), "quantization_group_size 64"),
    (lambda: quantize(torch.zeros(4, 64, dtype=torch.int32), 8), "float matrix"),
])
def test_bad_layouts_are_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()
