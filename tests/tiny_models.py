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
