"""Which quantization a model is served with: the request, the checkpoint and the files."""

from __future__ import annotations

import pytest

from pdserve.engine.quantization import Quantization, resolve_quantization


@pytest.mark.parametrize("requested,checkpoint,gguf,group,want", [
    (None, None, False, 0, None),
    ("int4", None, False, 64, Quantization("int4", 64)),
    ("int8", None, True, 0, Quantization("int8")),
    ("gguf", None, True, 0, Quantization("gguf")),
    (None, "gptq", False, 0, Quantization("gptq")),
    ("awq", "awq", False, 0, Quantization("awq")),
])
def test_resolved(requested, checkpoint, gguf, group, want):
    assert resolve_quantization(requested, checkpoint, gguf, group) == want


@pytest.mark.parametrize("requested,checkpoint,gguf,group,match", [
    ("int3", None, False, 0, "quantization must be one of"),
    ("gguf", None, False, 0, "no \\*.gguf file"),
    ("gptq", None, False, 0, "has no gptq quantization_config"),
    ("int4", "awq", False, 0, "already quantized with awq"),
    (None, "bitsandbytes", False, 0, "quant_method: 'bitsandbytes'"),
    ("gguf", None, True, 32, "quantization_group_size applies"),
    ("int4", None, False, -1, "quantization_group_size must be"),
])
def test_refused_naming_the_field(requested, checkpoint, gguf, group, match):
    with pytest.raises(ValueError, match=match):
        resolve_quantization(requested, checkpoint, gguf, group)


def test_bits_only_for_round_to_nearest():
    assert Quantization("int4").bits == 4 and Quantization("int8").bits == 8
    assert Quantization("gguf").bits is None
