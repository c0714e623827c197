"""Model config reading: head_dim, sliding window, refusals that name the field."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.config import CacheConfig, load_model_config, with_num_blocks


def write_config(tmp_path, **values):
    base = {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 100,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    }
    (tmp_path / "config.json").write_text(json.dumps({**base, **values}))
    return tmp_path


def test_a_sliding_window_no_longer_caps_the_context(tmp_path):
    path = write_config(tmp_path, sliding_window=4096)
    assert load_model_config(path).max_model_len == 32768
    assert load_model_config(path, max_model_len=8192).max_model_len == 8192


def test_explicit_head_dim_and_rope_parameters(tmp_path):
    path = write_config(tmp_path, head_dim=32, sliding_window=None)
    config = load_model_config(path, max_model_len=1000)
    assert config.head_dim == 32 and config.max_model_len == 1000
    assert config.rope_parameters["rope_theta"] == 10000.0


def test_unsupported_architecture_is_named(tmp_path):
    path = write_config(tmp_path, model_type="llama", architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(ValueError, match="architectures: 'GPTNeoXForCausalLM'.*Qwen3Moe"):
        load_model_config(path)


def test_pdserve_models_lists_every_registered_architecture_and_known_name(capsys):
    from pdserve.cli import main
    from pdserve.engine.default_model import PACKAGED_MODELS
    from pdserve.engine.models import MODELS, model_class

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for arch in MODELS:
        assert arch in out
        assert model_class(arch).__name__ == MODELS[arch][1]
    assert all(known.aliases[0] in out for known in PACKAGED_MODELS)


def test_layer_windows_follow_layer_types_or_one_window(tmp_path):
    path = write_config(tmp_path, sliding_window=4096)
    assert load_model_config(path).layer_windows == (4096, 4096)  # Mistral: every layer
    qwen = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64,
            "use_sliding_window": True, "max_window_layers": 1}
    assert load_model_config(write_config(tmp_path, **qwen)).layer_windows == (None, 64)
    qwen["use_sliding_window"] = False
    assert load_model_config(write_config(tmp_path, **qwen)).layer_windows == (None, None)


def test_dtype_and_kv_budget_are_checked(tmp_path):
    path = write_config(tmp_path, sliding_window=None)
    with pytest.raises(ValueError, match="dtype"):
        load_model_config(path, dtype="int4")
    config = load_model_config(path, max_model_len=4096)
    per_block = 16 * config.kv_bytes_per_token()
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        with_num_blocks(CacheConfig(kv_cache_memory_bytes=per_block * 10), config)
    sized = with_num_blocks(CacheConfig(kv_cache_memory_bytes=per_block * 300), config)
    assert sized.num_blocks == 300


@pytest.mark.parametrize("named,served", [
    ({"dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "float16"}, "float16"),  # the pre-transformers-5 key
    ({}, "float32"),  # none named
    ({"dtype": "float64"}, "float32"),  # one the engine does not run
])
def test_auto_dtype_is_the_checkpoints(tmp_path, named, served):
    path = write_config(tmp_path, sliding_window=None, **named)
    assert load_model_config(path).dtype == served  # "auto" is the default
    assert load_model_config(path, dtype="float32").dtype == "float32"


def test_the_bundled_model_serves_in_its_upstream_dtype(smollm2_dir):
    """SmolLM2 was published in bf16; the converted weights are fp32 (the GGUF, exactly)."""
    assert load_model_config(smollm2_dir).dtype == "bfloat16"
