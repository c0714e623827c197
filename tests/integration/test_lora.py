"""Multi-LoRA offline: one mixed batch of the base model and three adapters (other ranks and
targets, one rsLoRA) gives, per prompt, transformers' greedy tokens on the merged weights
(W + scale B A, by PEFT); with fewer slots (max_loras) and host copies (max_cpu_loras) than
adapters, so steps hold adapters back and slots and host copies are reused. The prefix cache
keys blocks by adapter. A bad adapter is a ValueError naming what is wrong, and nothing runs."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM, LoRARequest, SamplingParams
from tests.integration.hf_reference import mixed_prompts
from tests.lora_adapters import merged_model, write_lora_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = {"num_kv_blocks": 96, "max_model_len": 512, "num_threads": 1}


@cache
def hf_lora_greedy(base: Path, adapter: Path | None, prompt: tuple[int, ...]) -> list[int]:
    from tests.integration.hf_reference import hf_greedy

    if adapter is None:
        return list(hf_greedy(base, (prompt,), GREEDY.max_tokens)[0])
    model = _merged(base, adapter)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=GREEDY.max_tokens, pad_token_id=2)
    return out[0, len(prompt):].tolist()


@cache
def _merged(base: Path, adapter: Path):
    return merged_model(base, adapter)


def loras(dirs: dict[str, Path]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i, str(path))
            for i, (name, path) in enumerate(sorted(dirs.items()), 1)}


def test_mixed_batch_matches_merged_weights(tiny_llama_dir, tiny_lora_dirs):
    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_loras=2, max_cpu_loras=2,
              max_lora_rank=16, **ENGINE)
    adapters = loras(tiny_lora_dirs)
    prompts = [list(p) for p in mixed_prompts(49152, seed=21)[:8]]
    names = [None, "all", "attn", "mlp", "all", None, "mlp", "attn"]
    outs = llm.generate(prompts, GREEDY, [adapters.get(n) for n in names])
    for prompt, name, out in zip(prompts, names, outs):
        adapter = tiny_lora_dirs[name] if name else None
        assert out.token_ids == hf_lora_greedy(tiny_llama_dir, adapter, tuple(prompt)), name
    base = [o.token_ids for o, n in zip(outs, names) if n is None]
    assert all(o.token_ids not in base for o, n in zip(outs, names) if n), "adapters change nothing"
    slots = llm.engine.core.runner.loras
    assert len(slots._host) <= 2 and len(slots._slots) <= 2


def test_speculation_keeps_the_adapter(tiny_llama_dir, tiny_lora_dirs):
    """The base model drafts (a draft model runs no adapter); the target verifies with each
    request's adapter: the merged weights' tokens, the base request's drafts accepted."""
    spec = {"method": "draft", "num_speculative_tokens": 3, "model": str(tiny_llama_dir)}
    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_loras=3, speculative_config=spec,
              **ENGINE)
    adapters = loras(tiny_lora_dirs)
    prompts = [list(p) for p in mixed_prompts(49152, seed=23)[1:7]]
    names = ["all", "attn", "mlp", None, "all", "mlp"]
    outs = llm.generate(prompts, GREEDY, [adapters.get(n) for n in names])
    for prompt, name, out in zip(prompts, names, outs):
        adapter = tiny_lora_dirs[name] if name else None
        assert out.token_ids == hf_lora_greedy(tiny_llama_dir, adapter, tuple(prompt)), name
    assert llm.engine.core.scheduler.stats.num_accepted_tokens > 0


def test_prefix_cache_keys_blocks_by_adapter(tiny_llama_dir, tiny_lora_dirs):
    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_loras=2, **ENGINE)
    adapters = loras(tiny_lora_dirs)
    prompt = list(mixed_prompts(49152, seed=22)[0][:100])  # 6 full blocks
    first = llm.generate([prompt], GREEDY, adapters["all"])[0]
    other = llm.generate([prompt], GREEDY, adapters["mlp"])[0]
    base = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY, adapters["all"])[0]
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.num_cached_tokens == 96 and again.token_ids == first.token_ids
    assert len({tuple(o.token_ids) for o in (first, other, base)}) == 3
    pool = llm.engine.core.kv_cache.pool
    assert pool.num_free_blocks == ENGINE["num_kv_blocks"]  # every block back (cached-free)


def test_phi3_fused_modules(tmp_path):
    """Phi-3 keeps q/k/v and gate/up fused in its checkpoint, and PEFT adapts them as such
    (qkv_proj, gate_up_proj): one A for the fused output, its B cut into the slices."""
    from tests.tiny_models import write_tiny_model

    base = write_tiny_model(tmp_path / "phi3", "phi3", seed=4, pad_token_id=0)
    adapter = write_lora_adapter(base, tmp_path / "adapter", rank=8, seed=16, targets=(
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, **ENGINE)
    prompts = [list(p) for p in mixed_prompts(49152, seed=24)[:3]]
    outs = llm.generate(prompts, GREEDY, LoRARequest("phi", 1, str(adapter)))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_lora_greedy(base, adapter, tuple(prompt))
    assert outs[0].token_ids != llm.generate(prompts[:1], GREEDY)[0].token_ids


def _rewrite(src: Path, out: Path, config=None, tensors=None) -> Path:
    """A copy of adapter `src` with its config and tensors edited."""
    out.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps(config(cfg) if config else cfg))
    weights = load_file(str(src / "adapter_model.safetensors"))
    save_file(tensors(weights) if tensors else weights, str(out / "adapter_model.safetensors"))
    return out


def test_bad_adapters_are_refused_by_name(tiny_llama_dir, tiny_lora_dirs, tmp_path):
    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_lora_rank=8, **ENGINE)
    src = tiny_lora_dirs["all"]
    other_base = write_lora_adapter(_wider_model(tmp_path), tmp_path / "wider", rank=4)
    cases = {
        "no adapter_config.json": tmp_path / "absent",
        "rank 16 is above max_lora_rank": tiny_lora_dirs["attn"],
        "lora_A.weight has no base_model.model.model.layers.0.self_attn.q_proj.lora_B": _rewrite(
            src, tmp_path / "half", tensors=lambda w: {
                k: v for k, v in w.items() if "layers.0.self_attn.q_proj.lora_B" not in k}),
        "not a LoRA weight of a module this server adapts": _rewrite(
            src, tmp_path / "head", tensors=lambda w: {
                **w, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}),
        "in layer 7": _rewrite(
            src, tmp_path / "deep", tensors=lambda w: {
                k.replace("layers.1.", "layers.7."): v for k, v in w.items()}),
        "an adapter of another base model": other_base,
        "use_dora=True": _rewrite(src, tmp_path / "dora",
                                  config=lambda c: {**c, "use_dora": True}),
    }
    good = LoRARequest("good", 1, str(src))
    for i, (why, path) in enumerate(cases.items(), 2):
        with pytest.raises(ValueError, match="lora_path: ") as err:
            llm.generate(["hi", "there"], GREEDY, [good, LoRARequest("bad", i, str(path))])
        assert why in str(err.value), (why, str(err.value))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.kv_cache.num_free_blocks == ENGINE["num_kv_blocks"]
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        LLM(str(tiny_llama_dir), **ENGINE).generate(["hi"], GREEDY, good)


def _wider_model(tmp_path: Path) -> Path:
    from tests.tiny_models import write_tiny_model

    return write_tiny_model(tmp_path / "wider-base", "llama", seed=3, hidden_size=96)
