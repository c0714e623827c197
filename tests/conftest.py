"""Shared fixtures: the real SmolLM2 checkpoint and tiny random Llama / Qwen2 checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

from tests.kernel_device import set_interpreter

# Triton's interpreter, unless in GPU mode; must be set before `kernels` is imported.
set_interpreter(os.environ)

import pytest  # noqa: E402

from pdserve.engine.default_model import ensure_default_model  # noqa: E402
from tests.tiny_models import write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct in HF format (converted from the packaged GGUF once)."""
    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=2)


@pytest.fixture(scope="session")
def tiny_lora_dirs(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """Three PEFT adapters of the tiny Llama, of other ranks and targets: "all" (rank 8, every
    linear), "attn" (rank 16, q/v, rsLoRA), "mlp" (rank 4, gate/up/down)."""
    from tests.lora_adapters import write_lora_adapter

    root = tmp_path_factory.mktemp("tiny-loras")
    specs = {"all": {"rank": 8, "seed": 11},
             "attn": {"rank": 16, "targets": ("q_proj", "v_proj"), "use_rslora": True,
                      "seed": 12, "std": 0.2},
             "mlp": {"rank": 4, "targets": ("gate_proj", "up_proj", "down_proj"), "seed": 13}}
    return {name: write_lora_adapter(tiny_llama_dir, root / name, **spec)
            for name, spec in specs.items()}
