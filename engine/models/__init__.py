"""Model registry: one table from a checkpoint's HF `architectures` name to our network class.

The table names classes by module, so reading it (config checks, `pdserve models`) imports no
model code; `model_class` imports the one asked for.
"""

from __future__ import annotations

import importlib

# HF architecture -> (module under pdserve.engine.models, class)
MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("llama", "LlamaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekV3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(MODELS)


def model_class(architecture: str) -> type:
    module, name = MODELS[architecture]
    return getattr(importlib.import_module(f"pdserve.engine.models.{module}"), name)
