"""Our RoPE variants against transformers' own rope initialisation, and refusals."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.rope import inv_freq_and_scaling

VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    },
    "yarn": {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
        "original_max_position_embeddings": 32768,
    },
    "yarn-mscale": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
        "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 4096,
    },
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_transformers(name, head_dim):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = VARIANTS[name]
    config = LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=131072, rope_parameters=dict(params),
    )
    ours, our_scale = inv_freq_and_scaling(params, head_dim, 131072, 4096)
    if params["rope_type"] == "default":
        base = params["rope_theta"]
        ref = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    assert torch.equal(ours, ref.float())
    assert our_scale == pytest.approx(ref_scale, rel=1e-12)


def test_dynamic_within_original_window_is_default_and_beyond_is_refused():
    params = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    default, _ = inv_freq_and_scaling({"rope_theta": 10000.0}, 64, 4096, 4096)
    assert torch.equal(inv_freq_and_scaling(params, 64, 4096, 4096)[0], default)
    with pytest.raises(ValueError, match="rope_type"):
        inv_freq_and_scaling(params, 64, 4096, 8192)


@pytest.mark.parametrize("max_model_len", [4096, 8192])  # within the original context, past it
def test_longrope_takes_the_factors_transformers_takes_for_the_context(max_model_len):
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    g = torch.Generator().manual_seed(0)
    params = {"rope_type": "longrope", "rope_theta": 10000.0,
              "short_factor": (1 + torch.rand(32, generator=g)).tolist(),
              "long_factor": (1 + 8 * torch.rand(32, generator=g)).tolist(),
              "original_max_position_embeddings": 4096}
    config = Phi3Config(hidden_size=256, num_attention_heads=4, max_position_embeddings=131072,
                        original_max_position_embeddings=4096, rope_parameters=dict(params),
                        pad_token_id=0)
    ours, our_scale = inv_freq_and_scaling(params, 64, 131072, max_model_len)
    ref, ref_scale = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"),
                                                      seq_len=max_model_len)
    assert torch.equal(ours, ref.float())
    assert our_scale == pytest.approx(ref_scale, rel=1e-12)


def test_unknown_rope_type_is_refused_by_name():
    with pytest.raises(ValueError, match="rope_scaling.rope_type"):
        inv_freq_and_scaling({"rope_type": "su-perb", "rope_theta": 1.0}, 64, 4096, 4096)
