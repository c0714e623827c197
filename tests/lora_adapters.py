"""Write LoRA adapters with PEFT itself (its real on-disk format) over a test checkpoint, and
the merged model (W + scale * B A, by PEFT's `merge_and_unload`) transformers checks against."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora_adapter(base: str | Path, out: str | Path, rank: int = 8,
                       targets: tuple[str, ...] = ALL_TARGETS, seed: int = 0,
                       alpha: float = 16, use_rslora: bool = False, std: float = 0.1) -> Path:
    """A PEFT LoRA adapter of `base` at `out`: random A and non-zero random B (std `std`),
    so its answers differ from the base model's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        use_rslora=use_rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(str(out))
    return Path(out)


def merged_model(base: str | Path, adapter: str | Path):
    """transformers' model of `base` with the adapter merged into its weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
