"""LoRARequest: which LoRA adapter a request runs with, as vLLM names it. No torch.

An adapter is named by `lora_name` (what clients send as the OpenAI `model`), numbered by
`lora_int_id` (unique per adapter in one engine, > 0) and found at `lora_path`, a directory in
PEFT's format (`adapter_config.json` + `adapter_model.safetensors`) on every worker's disk.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
