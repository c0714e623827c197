"""Model registry: HF architecture name -> our network class."""

from __future__ import annotations

from pdserve.engine.models.llama import LlamaForCausalLM

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}
