"""Write small random-weight checkpoints (HF format) of every served architecture for fast tests.

The weights are drawn with a large enough spread that logits are well separated, so greedy
decoding is not decided by float rounding and two correct implementations agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pdserve.engine.default_model import ensure_default_model

_BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


# Configurations of every architecture's features, each a (model_type, overrides) for
# `write_tiny_model`: the integration tests hold them to transformers, the on-device check
# (tests/on_device) runs them on a GPU against the CPU reference.
GEMMA3_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
               "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}
CASES = {
    "qwen3-gqa-head_dim": ("qwen3", dict(head_dim=32)),
    "qwen3-mqa-tied-window": ("qwen3", dict(
        num_key_value_heads=1, tie_word_embeddings=True, use_sliding_window=True,
        sliding_window=40, max_window_layers=1)),
    "mistral-window": ("mistral", dict(sliding_window=40)),
    "phi3": ("phi3", dict(pad_token_id=0)),
    "phi3-longrope-window": ("phi3", dict(
        pad_token_id=0, sliding_window=48, original_max_position_embeddings=512,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                      "long_factor": [2.0 + i for i in range(8)]})),
    "gemma2-softcap": ("gemma2", dict(
        head_dim=16, sliding_window=40, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
        final_logit_softcapping=15.0)),
    "gemma3-local-global": ("gemma3_text", dict(
        num_hidden_layers=3, head_dim=32, sliding_window=40,
        layer_types=GEMMA3_TYPES, rope_parameters=GEMMA3_ROPE, query_pre_attn_scalar=32)),
    "mixtral-top2": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-top1-of-2": ("mixtral", dict(num_local_experts=2, num_experts_per_tok=1)),
    "qwen3moe-top1": ("qwen3_moe", dict(
        num_experts=8, num_experts_per_tok=1, moe_intermediate_size=48, norm_topk_prob=False)),
    "qwen3moe-top4-sparse-step": ("qwen3_moe", dict(
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[2])),
    # latent attention: q LoRA, YaRN with mscale, a dense first layer, 2 of 4 expert groups
    "deepseek-v3-qlora-grouped": ("deepseek_v3", dict(
        num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8,
        n_shared_experts=1, moe_intermediate_size=32, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256, "mscale": 1.0,
                         "mscale_all_dim": 1.0})),
    # one q_proj, top-1 of 4 without renormalizing, two shared experts, every layer sparse
    "deepseek-v3-qproj-top1": ("deepseek_v3", dict(
        num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=24, v_head_dim=16, n_routed_experts=4, n_shared_experts=2,
        moe_intermediate_size=16, n_group=1, topk_group=1, num_experts_per_tok=1,
        first_k_dense_replace=0, norm_topk_prob=False, routed_scaling_factor=1.0)),
    # attention sinks on sliding-window (40, shorter than the prompts) and full layers; top-2
    # of 4 biased experts with the clamped SwiGLU; YaRN
    "gpt-oss-sinks-window": ("gpt_oss", dict(
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, sliding_window=40,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 8.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False})),
}


def write_tiny_model(
    out: str | Path, model_type: str = "llama", seed: int = 0, tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """A random checkpoint sharing SmolLM2's tokenizer (so text prompts work), at `out`.

    `tokenizer=False` writes none (prompts are token ids; `vocab_size` is then an override):
    where SmolLM2 is not at hand, as on a lent GPU machine (scripts/gpu_check.sh).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    tok = AutoTokenizer.from_pretrained(str(ensure_default_model())) if tokenizer else None
    values = {**_BASE, **({"vocab_size": len(tok)} if tok else {}), **overrides}
    values.setdefault("tie_word_embeddings", model_type == "qwen2")
    config = AutoConfig.for_model(model_type, **values)
    config.architectures = [ARCHITECTURES[model_type]]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15 if "embed" in name else 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's routing bias
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(str(out))
    if tok is not None:
        tok.save_pretrained(str(out))
    return out


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [..., K] (K a multiple of 32) as MXFP4 blocks [..., K/32, 16] and scales
    [..., K/32], uint8: each group's scale the power of two that puts its largest magnitude in
    (3, 6], each value rounded to the nearest E2M1 code (engine.mxfp4's format)."""
    from pdserve.engine.mxfp4 import E2M1, GROUP

    groups = weight.float().reshape(*weight.shape[:-1], -1, GROUP)
    peak = groups.abs().amax(dim=-1).clamp(min=2.0**-120)
    exponent = torch.ceil(torch.log2(peak / 6.0))
    codes = torch.tensor(E2M1)
    scaled = groups / torch.exp2(exponent)[..., None]
    index = (scaled[..., None] - codes).abs().argmin(dim=-1).to(torch.uint8)  # [..., G, 32]
    blocks = index[..., 0::2] | (index[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def write_mxfp4_twin(dense_dir: str | Path, out: str | Path) -> Path:
    """A copy of the tiny gpt-oss checkpoint at `dense_dir` with its experts in MXFP4 (as
    released gpt-oss checkpoints store them), and `dense_dir`'s experts replaced by exactly the
    values the MXFP4 codes stand for (transformers' own dequantization), so transformers on
    the dense one is the reference for the MXFP4 one."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dense_dir, out = Path(dense_dir), Path(out)
    shutil.copytree(dense_dir, out, dirs_exist_ok=True)
    tensors = load_file(str(dense_dir / "model.safetensors"))
    dense, packed = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # [E, out, in]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=tensor.dtype)
        else:
            dense[name] = packed[name] = tensor
    save_file(dense, str(dense_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(packed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
