"""GPTQ / AWQ checkpoints into the int4 layout, against the formats' own dequantization.

The fp16 scale times an integer |q - zero| <= 16 is exact in fp32, so the converted weight
must dequantize to the reference bit for bit (rtol = atol = 0), and rounding it to fp16 must
give the fp16 arithmetic the formats' torch paths use, also exactly.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.quant_checkpoints import (
    CheckpointQuant,
    checkpoint_quantization,
    convert_linear,
    iter_quantized,
)
from pdserve.kernels.quant_weights import QuantizedWeight, dequantize
from tests.quant_checkpoint_files import (
    awq_tensors,
    dense_tensors,
    gptq_tensors,
    random_linear,
    write_checkpoint,
)

Q_PROJ = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.0.mlp.down_proj"
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": False,
        "checkpoint_format": "gptq"}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True,
       "version": "gemm"}


def _linears(seed: int, group: int, zeros: tuple[int, int]):
    gen = torch.Generator().manual_seed(seed)
    q = random_linear(32, 32, group, zeros, gen)  # in 32, out 32
    down = random_linear(64, 16, group, zeros, gen)  # in 64, out 16
    return gen, q, down


def _exact(w: QuantizedWeight, lin) -> None:
    assert isinstance(w, QuantizedWeight) and w.bits == 4 and w.group_size == lin.group
    assert w.shape == (lin.q.shape[1], lin.q.shape[0])
    torch.testing.assert_close(dequantize(w), lin.reference(), rtol=0, atol=0)
    torch.testing.assert_close(dequantize(w).half(), lin.reference_fp16(), rtol=0, atol=0)


def test_not_quantized_is_none(tmp_path):
    write_checkpoint(tmp_path, None, [{"x": torch.zeros(2)}])
    assert checkpoint_quantization(tmp_path) is None


def test_gptq_v1_split_across_files(tmp_path):
    gen, q, down = _linears(0, 16, (1, 16))  # v1 stores zero - 1, so real zeros are 1..16
    dense = dense_tensors(gen)
    q_parts = gptq_tensors(Q_PROJ, q)
    first = {**dense, **{k: v for k, v in q_parts.items() if "qweight" in k or "qzeros" in k}}
    second = {**{k: v for k, v in q_parts.items() if k not in first}, **gptq_tensors(DOWN, down)}
    write_checkpoint(tmp_path, GPTQ, [first, second])
    quant = checkpoint_quantization(tmp_path)
    assert quant == CheckpointQuant("gptq", 4, 16, "gptq", desc_act=False, sym=False)
    got = dict(iter_quantized(tmp_path, quant))
    assert set(got) == {*dense, f"{Q_PROJ}.weight", f"{DOWN}.weight"}
    _exact(got[f"{Q_PROJ}.weight"], q)
    _exact(got[f"{DOWN}.weight"], down)
    for name, tensor in dense.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)


def test_gptq_desc_act_with_trivial_g_idx_from_quantize_config(tmp_path):
    _, q, down = _linears(1, 16, (1, 16))
    config = {"bits": 4, "group_size": 16, "desc_act": True, "static_groups": True,
              "sym": True}  # AutoGPTQ's quantize_config.json names no quant_method
    write_checkpoint(tmp_path, config, [{**gptq_tensors(Q_PROJ, q), **gptq_tensors(DOWN, down)}],
                     separate_config="quantize_config.json")
    quant = checkpoint_quantization(tmp_path)
    assert quant.method == "gptq" and quant.desc_act
    got = dict(iter_quantized(tmp_path, quant))
    _exact(got[f"{Q_PROJ}.weight"], q)
    _exact(got[f"{DOWN}.weight"], down)


def test_gptq_act_order_g_idx_refused(tmp_path):
    _, q, _ = _linears(2, 16, (1, 16))
    g_idx = (torch.arange(32) // 16)[torch.randperm(32, generator=torch.Generator().manual_seed(0))]
    write_checkpoint(tmp_path, {**GPTQ, "desc_act": True}, [gptq_tensors(Q_PROJ, q, g_idx)])
    with pytest.raises(ValueError, match=rf"{Q_PROJ}\.g_idx: act-order \(desc_act\)"):
        list(iter_quantized(tmp_path, checkpoint_quantization(tmp_path)))


def test_gptq_v2_and_per_channel(tmp_path):
    gen = torch.Generator().manual_seed(3)
    q = random_linear(32, 32, 32, (0, 15), gen)  # v2 stores the zero itself
    down = random_linear(64, 16, 64, (0, 15), gen)  # group_size -1: one group of in_features
    config = {**GPTQ, "group_size": -1, "checkpoint_format": "gptq_v2"}
    write_checkpoint(tmp_path, config, [{**gptq_tensors(Q_PROJ, q, v1=False),
                                         **gptq_tensors(DOWN, down, v1=False)}])
    got = dict(iter_quantized(tmp_path, checkpoint_quantization(tmp_path)))
    _exact(got[f"{Q_PROJ}.weight"], q)
    _exact(got[f"{DOWN}.weight"], down)


def test_awq_gemm(tmp_path):
    gen, q, down = _linears(5, 16, (0, 15))
    dense = dense_tensors(gen)
    write_checkpoint(tmp_path, AWQ, [dense, {**awq_tensors(Q_PROJ, q), **awq_tensors(DOWN, down)}])
    quant = checkpoint_quantization(tmp_path)
    assert quant == CheckpointQuant("awq", 4, 16, "gemm")
    got = dict(iter_quantized(tmp_path, quant))
    assert set(got) == {*dense, f"{Q_PROJ}.weight", f"{DOWN}.weight"}
    _exact(got[f"{Q_PROJ}.weight"], q)
    _exact(got[f"{DOWN}.weight"], down)
    for name, tensor in dense.items():
        assert torch.equal(got[name], tensor)


def _word(value: int) -> int:
    """An unsigned 32-bit literal as the int32 a checkpoint stores."""
    return value - 2**32 if value >= 2**31 else value


def test_literal_words():
    """Hand-written words: GPTQ value j at bits 4j is input row j; AWQ's is column order[j]."""
    low, high = _word(0x76543210), _word(0xFEDCBA98)  # high: a negative int32
    gptq = convert_linear("gptq", {
        "qweight": torch.tensor([[low] * 8, [high] * 8], dtype=torch.int32),  # in 16, out 8
        "qzeros": torch.zeros(1, 1, dtype=torch.int32),  # v1: stored 0 is zero 1
        "scales": torch.ones(1, 8, dtype=torch.float16)}, CheckpointQuant("gptq", 4, -1, "gptq"))
    assert torch.equal(dequantize(gptq), (torch.arange(16.0) - 1).expand(8, 16))
    awq = convert_linear("awq", {
        "qweight": torch.full((16, 1), high, dtype=torch.int32),  # in 16, out 8
        "qzeros": torch.full((1, 1), 0x01234567, dtype=torch.int32),
        "scales": torch.full((1, 8), 0.5, dtype=torch.float16)},
        CheckpointQuant("awq", 4, -1, "gemm"))
    column = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # AWQ order: nibble j is column order[j]
    q, zero = torch.empty(8), torch.empty(8)
    q[column], zero[column] = torch.arange(8.0) + 8, 7 - torch.arange(8.0)
    assert torch.equal(dequantize(awq), (0.5 * (q - zero))[:, None].expand(8, 16))


@pytest.mark.parametrize(("config", "message"), [
    ({**GPTQ, "bits": 8}, r"quantization_config\.bits: only 4-bit gptq.*got 8"),
    ({**AWQ, "bits": 3}, r"quantization_config\.bits: only 4-bit awq.*got 3"),
    ({**AWQ, "version": "gemv"}, r"quantization_config\.version: awq format 'gemv'"),
    ({**AWQ, "version": "GEMV_FAST"}, r"quantization_config\.version: awq format 'gemv_fast'"),
    ({**AWQ, "version": "marlin"}, r"quantization_config\.version: awq format 'marlin'"),
    ({**AWQ, "zero_point": False}, r"quantization_config\.zero_point"),
    ({**GPTQ, "checkpoint_format": "marlin"}, r"checkpoint_format: gptq format 'marlin'"),
    ({**GPTQ, "is_marlin_format": True}, r"quantization_config\.is_marlin_format"),
    ({**GPTQ, "dynamic": {"-:.*down": {}}}, r"quantization_config\.dynamic"),
    ({**GPTQ, "group_size": 0}, r"quantization_config\.group_size"),
    ({"quant_method": "bitsandbytes"}, r"quantization_config\.quant_method: 'bitsandbytes'"),
])
def test_refused_configs(tmp_path, config, message):
    write_checkpoint(tmp_path, config, [{"x": torch.zeros(2)}])
    with pytest.raises(ValueError, match=message):
        checkpoint_quantization(tmp_path)


def test_missing_part_and_bad_shape(tmp_path):
    _, q, _ = _linears(7, 16, (1, 16))
    parts = gptq_tensors(Q_PROJ, q)
    write_checkpoint(tmp_path / "a", GPTQ, [{k: v for k, v in parts.items() if "qzeros" not in k}])
    with pytest.raises(ValueError, match=rf"lacks its {Q_PROJ}\.qzeros"):
        list(iter_quantized(tmp_path / "a", checkpoint_quantization(tmp_path / "a")))
    bad = {**parts, f"{Q_PROJ}.scales": parts[f"{Q_PROJ}.scales"][:1]}
    write_checkpoint(tmp_path / "b", GPTQ, [bad])
    with pytest.raises(ValueError, match=rf"{Q_PROJ}\.scales must be \[2, 32\]"):
        list(iter_quantized(tmp_path / "b", checkpoint_quantization(tmp_path / "b")))
