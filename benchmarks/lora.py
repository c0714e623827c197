"""Multi-LoRA throughput: 32 requests over 8 adapters vs the same 32 on the base model alone,
in one engine, in the same run.

- adapters: 8 random rank-`--rank` adapters of the default model (SmolLM2-135M) adapting
  every linear (q/k/v/o, gate/up/down), written in PEFT's on-disk format
  (`adapter_config.json` + `adapter_model.safetensors`) to a temporary directory;
- engine: `LLM(enable_lora=True, max_loras=8, max_lora_rank=rank)` in bf16 (the served
  dtype); 32 prompts of 64 random tokens, 64 greedy tokens each (ignore_eos), all submitted
  at once: on the base model alone, then with adapter i % 8 on prompt i, alternating
  `--repeats` times (a warm-up pair first);
- printed: output tok/s of each run, the median of each, and their ratio (adapters / base).
  A step of base requests runs the fused C decoder layers; a step with an adapter the module
  path plus the LoRA ops (`kernels.cpu.lora`), which the ratio includes.

    .venv/bin/python -m benchmarks.lora --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.moe import cpu_info
from pdserve import LLM, LoRARequest, SamplingParams
from pdserve.engine.config import ModelConfig, load_model_config
from pdserve.engine.default_model import ensure_default_model

NUM_REQUESTS, NUM_ADAPTERS, PROMPT_TOKENS, MAX_TOKENS = 32, 8, 64, 64
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, model: ModelConfig, rank: int, seed: int) -> Path:
    """A random PEFT adapter of every linear of `model` (B non-zero), at `out`."""
    d, hidden, inter = model.head_dim, model.hidden_size, model.intermediate_size
    shapes = {"q_proj": (hidden, model.num_heads * d), "k_proj": (hidden, model.num_kv_heads * d),
              "v_proj": (hidden, model.num_kv_heads * d), "o_proj": (model.num_heads * d, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            kind = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(MODULES), "base_model_name_or_path": model.path}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def run(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> float:
    """Output tokens per second of one batch."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, loras)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path = ensure_default_model()
    model = load_model_config(path, "bfloat16")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.vocab_size, (PROMPT_TOKENS,), generator=g).tolist()
               for _ in range(NUM_REQUESTS)]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"adapter-{i}", i + 1,
                                str(write_adapter(Path(tmp) / str(i), model, args.rank, i)))
                    for i in range(NUM_ADAPTERS)]
        llm = LLM(str(path), dtype="bfloat16", enable_lora=True, max_loras=NUM_ADAPTERS,
                  max_lora_rank=args.rank, num_threads=args.threads, max_num_seqs=NUM_REQUESTS)
        with_loras = [adapters[i % NUM_ADAPTERS] for i in range(NUM_REQUESTS)]
        base_only = [None] * NUM_REQUESTS
        run(llm, prompts, base_only), run(llm, prompts, with_loras)  # warm-up
        base, lora = [], []
        for _ in range(args.repeats):
            base.append(run(llm, prompts, base_only))
            lora.append(run(llm, prompts, with_loras))
    cpu = cpu_info()
    print(f"CPU: {cpu['model_name']} ({cpu['cpus']} CPUs, AVX512-BF16 {cpu['avx512_bf16']}), "
          f"torch threads {args.threads}, kernels {llm.engine.core.runner.ops.name}")
    print(f"{NUM_REQUESTS} requests x {PROMPT_TOKENS} prompt + {MAX_TOKENS} output tokens, "
          f"bf16 {model.architecture}; {NUM_ADAPTERS} adapters of rank {args.rank} on every "
          "linear")
    print(f"base alone      tok/s: {', '.join(f'{x:.1f}' for x in base)}")
    print(f"8 adapters      tok/s: {', '.join(f'{x:.1f}' for x in lora)}")
    ratio = statistics.median(lora) / statistics.median(base)
    print(f"median: base {statistics.median(base):.1f}, adapters {statistics.median(lora):.1f}; "
          f"ratio {ratio:.2f}x (target >= 0.8x)")


if __name__ == "__main__":
    main()
