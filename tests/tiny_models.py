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
    "qwen3_moe": "Qwen3MoeForCausalLM",
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
    model.save_pretrained(str(out))
    if tok is not None:
        tok.save_pretrained(str(out))
    return out
