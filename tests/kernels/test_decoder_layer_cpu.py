"""A bf16 decoder layer as one C call per step (kernels.cpu.decoder_layers, the CPU backend's
`decoder_layers`) against the model's modules: the same kernels in the same order, so
hidden states and K/V caches must be bit-identical, on mixed steps (decodes beside a prefill
chunk after a cached prefix), with QKV bias (Qwen2), per-head q/k norms (Qwen3), a sliding
window (Mistral), split in halves under tensor parallelism, with LoRA adapters (the deltas added
by lora.c's kernels after each linear), and a bad slot must fail before any K/V is written."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import socket
import traceback
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig, load_model_config
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from pdserve.kernels.cpu import decoder_layers
from pdserve.kernels.decoder_layers import DecoderLayers
from pdserve.kernels.lora_mapping import LoRAMapping, lora_mapping
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(not decoder_layers.available(),
                                reason="no blocked bf16 linear here (neither AVX512-BF16 nor AVX2)")

PROMPT_A = tuple(range(100, 137))  # 37 tokens: 3 blocks of 16
PROMPT_B = tuple(range(300, 345))  # 45 tokens, computed in two chunks of 20 and 25
WINDOW = 20  # shorter than both prompts, not a whole number of blocks: B's second chunk
# (positions 20-44) starts seeing its first chunk's keys and ends seeing only its own


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory):
    """Qwen3: per-head q/k RMSNorms, head_dim 32 set apart from hidden / heads (q is 128 wide
    over a hidden of 64); layer 0 full attention, layer 1 a WINDOW-token window."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", seed=3, head_dim=32,
                            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


@pytest.fixture(scope="module")
def tiny_mistral_window_dir(tmp_path_factory):
    """Mistral with every layer's window WINDOW tokens."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "mistral", seed=4,
                            sliding_window=WINDOW)


def make_runner(model_dir, tp: TensorParallel | None = None, threads: int = 2,
                lora: LoRAConfig | None = None) -> ModelRunner:
    config = EngineConfig(
        model=load_model_config(model_dir, dtype="bfloat16", max_model_len=256),
        cache=CacheConfig(block_size=16, num_blocks=32), num_threads=threads,
        kernel_backend="cpu", lora=lora,
    )
    return ModelRunner(config, tp)


def entry(rid: str, tokens: tuple[int, ...], start: int, blocks: tuple[int, ...]):
    return ScheduledRequest(rid, tokens, start, blocks, None)


# step 1: A's whole prompt and B's first chunk; step 2: A decodes, B's second chunk
A_BLOCKS, B_BLOCKS = (5, 2, 9), (1, 7, 3)
STEPS = (
    SchedulerOutput((entry("a", PROMPT_A, 0, A_BLOCKS), entry("b", PROMPT_B[:20], 0, B_BLOCKS))),
    SchedulerOutput((entry("a", (7,), 37, A_BLOCKS), entry("b", PROMPT_B[20:], 20, B_BLOCKS))),
)


def forward(runner: ModelRunner, plan: SchedulerOutput, lora: LoRAMapping | None = None
            ) -> torch.Tensor:
    input_ids, positions, meta, _ = runner._prepare(plan)
    meta = replace(meta, lora=lora)
    with torch.inference_mode():
        return runner.model(input_ids, positions, runner.kv_caches, meta)


def forward_modules(runner: ModelRunner, plan: SchedulerOutput,
                    lora: LoRAMapping | None = None) -> torch.Tensor:
    """The same step with the layers run as modules (the reference `decoder_layers`)."""
    model = runner.model
    input_ids, positions, meta, _ = runner._prepare(plan)
    meta = replace(meta, lora=lora)
    with torch.inference_mode():
        hidden = model.embed_tokens(input_ids)
        hidden, residual = DecoderLayers.forward(model.layers, hidden, positions,
                                                 runner.kv_caches, meta)
        return model.norm(hidden, residual)[0]


def run_both(model_dir, tp=None, threads=2, runner=None, steps=STEPS, loras=None):
    """(hidden states per step, caches) through the C layers, then through the modules, and
    the runner; `loras`: each step's adapter mapping."""
    runner = runner or make_runner(model_dir, tp, threads)
    assert runner.model.layers.fused is not None
    loras = loras or (None,) * len(steps)
    fused = [forward(runner, plan, lora) for plan, lora in zip(steps, loras)]
    fused_caches = [tuple(t.clone() for t in pair) for pair in runner.kv_caches]
    for pair in runner.kv_caches:
        for t in pair:
            t.fill_(float("nan"))  # what the modules do not write stays NaN and fails equal
    modules = [forward_modules(runner, plan, lora) for plan, lora in zip(steps, loras)]
    return fused, fused_caches, modules, runner


def written(cache: torch.Tensor, runner: ModelRunner, steps=STEPS) -> torch.Tensor:
    """The cache rows the steps wrote (the slots of every token of every step)."""
    slots = torch.cat([runner._prepare(plan)[2].slot_mapping for plan in steps])
    return cache.flatten(0, 1)[slots]


def assert_identical(fused, fused_caches, modules, runner, steps=STEPS) -> None:
    """Every step's hidden states and every written cache row, bit for bit."""
    for f, m in zip(fused, modules):
        assert f.dtype == torch.bfloat16 and not f.isnan().any()
        assert torch.equal(f, m)
    for f_pair, m_pair in zip(fused_caches, runner.kv_caches):
        for f, m in zip(f_pair, m_pair):
            assert not written(m, runner, steps).isnan().any()
            assert torch.equal(written(f, runner, steps), written(m, runner, steps))


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_one_call_per_layer_is_bit_identical_to_the_modules(model, request):
    assert_identical(*run_both(request.getfixturevalue(model)))


@pytest.mark.parametrize(("model", "head_norms", "windows"),
                         [("tiny_qwen3_dir", True, (0, WINDOW)),
                          ("tiny_mistral_window_dir", False, (WINDOW, WINDOW))],
                         ids=["qwen3", "mistral-window"])
def test_qk_norms_and_sliding_windows_run_fused_bit_identical(model, head_norms, windows,
                                                              request, monkeypatch):
    """Qwen3's layers (q/k norms; a full and a windowed one) and Mistral's (a window shorter
    than the prompts, crossed by prefill chunks and a decode) bind with their variants and
    run as one call per layer."""
    calls = []
    real = decoder_layers.decoder_layer_cpu
    monkeypatch.setattr(decoder_layers, "decoder_layer_cpu",
                        lambda *args, **kw: calls.append(1) or real(*args, **kw))
    result = run_both(request.getfixturevalue(model))
    fused = result[-1].model.layers.fused
    assert len(calls) == len(STEPS) * len(fused)  # the modules' run is not counted
    assert tuple(layer.struct.window for layer in fused) == windows
    for layer in fused:
        assert bool(layer.struct.q_norm) == bool(layer.struct.k_norm) == head_norms
    assert_identical(*result)


# LoRA: STEPS, then A and B decode beside C's prompt; each request's adapter slot per step
# (-1: the base model), so steps mix slots, base tokens, decodes and prefill chunks
PROMPT_C = tuple(range(500, 520))
LORA_STEPS = (*STEPS, SchedulerOutput((entry("a", (8,), 38, A_BLOCKS),
                                       entry("b", (9,), 45, B_BLOCKS),
                                       entry("c", PROMPT_C, 0, (4, 6)))))
LORA_SLOTS = ((2, -1), (2, 0), (1, -1, 0))


def lora_runner(model_dir, tp: TensorParallel | None = None, threads: int = 2) -> ModelRunner:
    """LoRA enabled (3 slots of rank 8), every slot of every linear (this rank's cut) random
    and non-zero."""
    runner = make_runner(model_dir, tp, threads, LoRAConfig(max_loras=3, max_lora_rank=8))
    g = torch.Generator().manual_seed(5)
    for stack in runner.loras.stacks.values():
        for w in (stack.weights.a, stack.weights.b):
            w.copy_(torch.randn(w.shape, generator=g) * 0.1)
    return runner


def lora_mappings(steps, slots) -> list[LoRAMapping]:
    return [lora_mapping(np.repeat(s, [e.num_tokens for e in plan.requests]),
                         torch.device("cpu")) for plan, s in zip(steps, slots)]


def test_lora_adapters_run_fused_bit_identical(tiny_llama_dir, monkeypatch):
    """Each layer binds its adapters' slots and a step with adapters runs as one call per
    layer: the same lora.c shrink and expand after each linear as the modules, bit for bit;
    and the adapters do change the output. A mapping the C cannot take (a slot past the
    weights') goes to the modules, which say what is wrong."""
    runner, calls = lora_runner(tiny_llama_dir), []
    layers, real = runner.model.layers, decoder_layers.decoder_layer_cpu
    assert layers.lora_slots == 3 and layers.lora_width == 3 * 8  # q/k/v of rank 8
    monkeypatch.setattr(decoder_layers, "decoder_layer_cpu",
                        lambda *args, **kw: calls.append(1) or real(*args, **kw))
    mappings = lora_mappings(LORA_STEPS, LORA_SLOTS)
    result = run_both(None, runner=runner, steps=LORA_STEPS, loras=mappings)
    assert len(calls) == len(LORA_STEPS) * len(layers.fused)
    assert_identical(*result, steps=LORA_STEPS)
    base = [forward(runner, plan) for plan in LORA_STEPS]
    assert not any(torch.equal(f, b) for f, b in zip(result[0], base))
    bad = lora_mapping(np.full(LORA_STEPS[0].total_num_tokens, 3), torch.device("cpu"))
    with pytest.raises(ValueError, match="out of the weights' 3 slots"):
        forward(runner, LORA_STEPS[0], bad)
    assert len(calls) == 2 * len(LORA_STEPS) * len(layers.fused)  # not the bad step


def test_halves_are_the_whole_layer(tiny_llama_dir):
    """ATTENTION then MLP (the calls a TP rank makes, all-reduce between) = both at once."""
    runner = make_runner(tiny_llama_dir)
    layers = runner.model.layers
    whole = forward(runner, STEPS[0])
    layers.parts = (decoder_layers.ATTENTION, decoder_layers.MLP)
    assert torch.equal(forward(runner, STEPS[0]), whole)


def test_a_slot_past_the_cache_fails_before_writing(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    input_ids, positions, meta, _ = runner._prepare(STEPS[0])
    bad = meta.slot_mapping.clone()
    bad[-1] = 32 * 16  # one past the last slot
    before = [t.clone() for t in runner.kv_caches[0]]
    with pytest.raises(IndexError, match="past the cache"), torch.inference_mode():
        runner.model(input_ids, positions, runner.kv_caches, replace(meta, slot_mapping=bad))
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches[0]))


def test_int8_caches_and_quantized_weights_keep_the_modules(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    int8 = [tuple(t.to(torch.int8) for t in pair) + pair for pair in runner.kv_caches]
    assert decoder_layers._plain_bf16(runner.kv_caches)
    assert not decoder_layers._plain_bf16(int8)
    config = EngineConfig(
        model=load_model_config(tiny_llama_dir, dtype="bfloat16", max_model_len=256,
                                quantization="int8"),
        cache=CacheConfig(block_size=16, num_blocks=32), num_threads=1, kernel_backend="cpu",
    )
    assert ModelRunner(config).model.layers.fused is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_rank(rank, port, model_dir, results):
    try:
        store = dist.TCPStore("127.0.0.1", port, None, rank == 0, wait_for_workers=False)
        group = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, 2,
                                      datetime.timedelta(seconds=60))
        runner = lora_runner(model_dir, TensorParallel(rank, 2, group), threads=1)
        assert runner.model.layers.lora_slots == 3  # this rank's cuts bound
        fused, _, modules, _ = run_both(None, runner=runner)  # base steps
        mappings = lora_mappings(LORA_STEPS, LORA_SLOTS)
        lora_fused, _, lora_modules, _ = run_both(None, runner=runner, steps=LORA_STEPS,
                                                  loras=mappings)
        results.put((rank, all(torch.equal(f, m) for f, m in zip(fused + lora_fused,
                                                                  modules + lora_modules))))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def test_tensor_parallel_halves_match_the_modules(tiny_llama_dir):
    """Two real ranks (gloo): each layer as two calls with the all-reduce between, base steps
    and steps with adapters (O's and down's deltas added to each rank's partial sums)."""
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_tp_rank, args=(r, port, tiny_llama_dir, results))
             for r in range(2)]
    for p in procs:
        p.start()
    outcome = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert outcome == {0: True, 1: True}
