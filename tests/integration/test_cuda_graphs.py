"""The decode graphs' path on the CPU (`emulate_cuda_graphs`: everything CUDA runs but the
capture): greedy outputs token-identical to the eager path while batches move across the
captured sizes and past the largest, replays counted at the padded sizes, and dummy rows that
write the dummy block alone."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from pdserve import LLM
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, load_model_config
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from pdserve.launch.settings import ServeSettings
from pdserve.worker_spec import WorkerSpec

SIZES = (1, 2, 4)
NUM_BLOCKS, BLOCK_SIZE = 48, 16


def engine_config(path, **kw) -> EngineConfig:
    return EngineConfig(
        model=load_model_config(path, "float32", max_model_len=128),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=256),
        num_threads=1, cuda_graph_sizes=SIZES, **kw,
    )


def run_staggered(engine: LLMEngine) -> dict[str, list[int]]:
    """Eight greedy requests arriving over the first steps, each to its own length: the
    decode batch grows 1, 2, 3, ... past the largest size (6: eager), then shrinks."""
    rng = random.Random(5)
    arrivals = {0: 1, 2: 1, 4: 1, 5: 1, 7: 2, 9: 2}  # step -> requests added
    outputs: dict[str, list[int]] = {}
    step = added = 0
    while step in arrivals or engine.has_unfinished_requests() or step < max(arrivals):
        for _ in range(arrivals.get(step, 0)):
            prompt = [rng.randrange(3, 40000) for _ in range(rng.randrange(3, 20))]
            params = SamplingParams(temperature=0, max_tokens=rng.randrange(4, 24),
                                    ignore_eos=True)
            engine.add_request(f"r{added}", prompt, params)
            added += 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        step += 1
    assert len(outputs) == added == 8
    return outputs


def test_graph_path_matches_eager_across_sizes(tiny_llama_dir):
    eager = LLMEngine(engine_config(tiny_llama_dir), None)
    graphed = LLMEngine(engine_config(tiny_llama_dir, emulate_cuda_graphs=True), None)
    runner = graphed.core.runner
    assert eager.core.runner.graphs is None
    plans: list[SchedulerOutput] = []
    execute = runner.execute
    runner.execute = lambda plan: plans.append(plan) or execute(plan)

    assert run_staggered(graphed) == run_staggered(eager)

    decode_batches = [len(p.requests) for p in plans
                      if p.requests and all(e.num_tokens == 1 for e in p.requests)]
    expected = Counter(min(s for s in SIZES if s >= n) for n in decode_batches if n <= SIZES[-1])
    assert runner.graphs.replays == expected
    assert set(expected) == set(SIZES)
    assert 3 in decode_batches and max(decode_batches) > SIZES[-1]  # padded; and eager
    # the same schedule, the same blocks: the real blocks hold the same K/V
    for real, reference in zip(runner.kv_caches, eager.core.runner.kv_caches):
        for got, want in zip(real, reference):
            assert got.shape[0] == NUM_BLOCKS
            torch.testing.assert_close(got, want)


def test_dummy_rows_write_the_dummy_block_alone(tiny_llama_dir):
    runner = ModelRunner(engine_config(tiny_llama_dir, emulate_cuda_graphs=True))
    caches = runner.graphs.kv_caches  # the pool's blocks, then the dummy one
    assert caches[0][0].shape[0] == NUM_BLOCKS + 1 and runner.kv_caches[0][0].shape[0] == 48
    torch.manual_seed(0)
    for layer in caches:
        for t in layer:
            t.normal_()  # any write shows
    before = [[t.clone() for t in layer] for layer in caches]
    positions, blocks = (5, 40, 17), ((3,), (7, 1, 30), (12, 2))
    plan = SchedulerOutput(tuple(
        ScheduledRequest(f"r{i}", (100 + i,), p, b, SamplingParams(temperature=0))
        for i, (p, b) in enumerate(zip(positions, blocks))))
    out = runner.execute(plan)

    assert runner.graphs.replays == {4: 1} and len(out.sampled_token_ids) == 3
    real_slots = {3 * 16 + 5, 30 * 16 + 8, 2 * 16 + 1}
    for layer, old in zip(caches, before):
        for t, was in zip(layer, old):
            changed = (t != was).flatten(2).any(-1).flatten()  # [(NUM_BLOCKS + 1) * 16]
            written = set(changed.nonzero().flatten().tolist())
            assert written == real_slots | {NUM_BLOCKS * BLOCK_SIZE}  # + the dummy's slot


def test_flags_reach_the_engine(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16, max_model_len=128, max_num_seqs=4,
              enforce_eager=True, cuda_graph_sizes=[1, 2])
    assert llm.config.enforce_eager and llm.config.capture_sizes == (1, 2)
    runner = llm.engine.core.runner
    assert runner.graphs is None and runner.kv_caches[0][0].shape[0] == 16
    sizes = ServeSettings.load(None, {"PDSERVE_CUDA_GRAPH_SIZES": "1, 2 8"}).graph_sizes()
    spec = WorkerSpec(worker_id="d", model=str(tiny_llama_dir), model_name="m",
                      enforce_eager=True, cuda_graph_sizes=sizes)
    config = spec.engine_config()
    assert config.enforce_eager and config.cuda_graph_sizes == (1, 2, 8)
    assert WorkerSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        LLM(str(tiny_llama_dir), max_num_seqs=4, cuda_graph_sizes=[8])
