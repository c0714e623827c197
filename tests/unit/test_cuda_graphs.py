"""Decode graphs' bookkeeping on the CPU: the padded size, which steps replay, the config's
sizes and modes, and the static buffers each replay fills (real rows, then dummy rows)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.engine.config import (
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    default_cuda_graph_sizes,
)
from pdserve.engine.cuda_graphs import (
    DecodeGraphs,
    EagerStepGraph,
    capturable,
    graph_batch_size,
    padded_batch_size,
    step_graph_factory,
)
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput

MODEL = ModelConfig(
    path="unused", architecture="LlamaForCausalLM", dtype="float32", vocab_size=100,
    hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    max_position_embeddings=64, max_model_len=64, tie_word_embeddings=False,
    attention_bias=False, eos_token_ids=(2,),
)
SIZE_SETS = [(1,), (4,), (1, 2, 4), (1, 2, 4, 8, 16, 24, 32), (3, 5, 6, 11)]


def decode(i: int, position: int, block_ids=(0,), **kw) -> ScheduledRequest:
    return ScheduledRequest(f"r{i}", (10 + i,), position, tuple(block_ids), SamplingParams(),
                            **kw)


@pytest.mark.parametrize("sizes", SIZE_SETS)
def test_padded_size_is_the_smallest_captured_size_that_holds_the_batch(sizes):
    for n in range(-1, sizes[-1] + 3):
        holding = [s for s in sizes if s >= n]
        expected = min(holding) if n >= 1 and holding else None
        assert padded_batch_size(n, sizes) == expected, (n, sizes)


def test_only_decode_only_steps_within_the_bound_replay():
    sizes, bound = (1, 2, 4), 64
    step = lambda *reqs: graph_batch_size(SchedulerOutput(reqs), sizes, bound)  # noqa: E731
    assert step(decode(0, 5)) == 1
    assert step(decode(0, 5), decode(1, 9), decode(2, 0)) == 4
    assert step(*(decode(i, 3) for i in range(5))) is None  # past the largest: eager
    assert step() is None
    prefill = ScheduledRequest("p", (1, 2, 3), 0, (0,), SamplingParams())
    assert step(decode(0, 5), prefill) is None
    drafts = ScheduledRequest("s", (7, 8), 4, (0,), SamplingParams(), num_spec_tokens=1)
    assert step(drafts) is None
    assert step(decode(0, 5), decode(1, 5, lora=LoRARequest("a", 1, "/a"))) is None
    assert step(decode(0, bound - 1)) == 1  # context bound: its new token is the last one
    assert step(decode(0, bound)) is None


@pytest.mark.parametrize("max_batch, sizes", [
    (1, (1,)), (3, (1, 2, 3)), (8, (1, 2, 4, 8)), (12, (1, 2, 4, 8, 12)),
    (128, (1, 2, 4, *range(8, 129, 8))), (4096, (1, 2, 4, *range(8, 513, 8))),
])
def test_default_sizes_are_vllms_up_to_the_largest_decode_batch(max_batch, sizes):
    assert default_cuda_graph_sizes(max_batch) == sizes


def test_config_sizes_and_mode():
    config = EngineConfig(MODEL, scheduler=SchedulerConfig(max_num_seqs=16,
                                                           max_num_batched_tokens=12))
    assert config.max_decode_batch == 12 and config.capture_sizes == (1, 2, 4, 8, 12)
    assert replace(config, cuda_graph_sizes=(2, 6)).capture_sizes == (2, 6)
    assert config.cuda_graph_mode is None  # the CPU: eager, as before
    assert replace(config, device="cuda:1").cuda_graph_mode == "cuda"
    assert replace(config, device="cuda", enforce_eager=True).cuda_graph_mode is None
    assert replace(config, emulate_cuda_graphs=True).cuda_graph_mode == "emulated"
    assert replace(config, device="cuda", emulate_cuda_graphs=True).cuda_graph_mode == "emulated"


@pytest.mark.parametrize("fields, match", [
    ({"cuda_graph_sizes": (4, 2)}, "ascending and unique"),
    ({"cuda_graph_sizes": (1, 2, 2)}, "ascending and unique"),
    ({"cuda_graph_sizes": (0, 2)}, "positive integers"),
    ({"cuda_graph_sizes": ()}, "positive integers"),
    ({"cuda_graph_sizes": [1, 2]}, "tuple"),
    ({"cuda_graph_sizes": (True,)}, "positive integers"),
    ({"cuda_graph_sizes": (1, 256)}, "256 exceeds the largest decode batch 128"),
    ({"enforce_eager": True, "emulate_cuda_graphs": True}, "set one of them"),
    ({"enforce_eager": "yes"}, "enforce_eager must be true or false"),
])
def test_config_refuses_bad_graph_settings(fields, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(MODEL, **fields)


def test_a_real_capture_needs_collectives_on_the_stream():
    named = lambda name: type("Group", (), {"name": lambda self: name})()  # noqa: E731
    assert capturable(1, None)
    assert capturable(2, named("nccl"))
    assert not capturable(2, named("gloo"))
    assert step_graph_factory("emulated") is EagerStepGraph
    with pytest.raises(ValueError, match="'cuda' or 'emulated'"):
        step_graph_factory("always")


class RecordingModel:
    """Returns each row's input id and position as its hidden state; records every call's
    static inputs (copies) and metadata."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, input_ids, positions, kv_caches, meta, layer_hook):
        d = meta.decode
        self.calls.append({
            "ids": input_ids.tolist(), "positions": positions.tolist(),
            "slots": meta.slot_mapping.tolist(), "tables": d.block_tables.clone(),
            "context_lens": d.context_lens.tolist(), "max": d.max_context_len,
            "num_decodes": meta.num_decode_tokens, "prefill": meta.prefill, "hook": layer_hook,
        })
        return torch.stack([input_ids, positions], dim=1).float()


def make_graphs(sizes=(1, 2, 4)) -> tuple[DecodeGraphs, RecordingModel]:
    model = RecordingModel()
    graphs = DecodeGraphs(model, [], sizes, block_size=4, max_model_len=30, dummy_block=9,
                          device=torch.device("cpu"), make_graph=EagerStepGraph)
    graphs.capture()
    return graphs, model


def test_capture_warms_up_and_captures_every_size_largest_first_on_dummy_rows():
    graphs, model = make_graphs()
    assert [len(c["ids"]) for c in model.calls] == [4, 4, 2, 2, 1, 1]  # two warm-ups each
    for call in model.calls:
        n = len(call["ids"])
        assert call["ids"] == [0] * n and call["positions"] == [0] * n
        assert call["slots"] == [9 * 4] * n and call["context_lens"] == [1] * n
        assert (call["tables"] == 9).all() and call["tables"].shape == (n, 8)  # ceil(30 / 4)
        assert call["max"] == 30 and call["num_decodes"] == n
        assert call["prefill"] is None and call["hook"] is None
    assert not graphs.replays


def test_replay_fills_real_rows_then_dummy_rows_and_counts_by_padded_size():
    graphs, model = make_graphs()
    reqs = (decode(0, 5, (3, 7)), decode(1, 0, (2,)), decode(2, 12, (1, 4, 6, 8, 5)))
    plan = SchedulerOutput(reqs)
    size = graphs.batch_size(plan)
    hidden = graphs.replay(plan, size)
    call = model.calls[-1]
    assert size == 4 and hidden.tolist() == [[10, 5], [11, 0], [12, 12]]
    assert call["ids"] == [10, 11, 12, 0] and call["positions"] == [5, 0, 12, 0]
    assert call["slots"] == [7 * 4 + 1, 2 * 4 + 0, 8 * 4 + 0, 9 * 4]
    assert call["context_lens"] == [6, 1, 13, 1] and call["max"] == 30
    tables = call["tables"].tolist()  # the blocks up to each new token's, then the dummy
    assert tables == [[3, 7] + [9] * 6, [2] + [9] * 7, [1, 4, 6, 8] + [9] * 4, [9] * 8]
    # a smaller step after it: the rows the bigger one left are dummy rows again
    graphs.replay(SchedulerOutput(reqs[:1]), 1)
    plan2 = SchedulerOutput((decode(3, 1, (5,)),) * 2 + (decode(4, 2, (6,)),))
    graphs.replay(plan2, graphs.batch_size(plan2))
    assert model.calls[-1]["ids"] == [13, 13, 14, 0]
    assert model.calls[-1]["slots"][3] == 9 * 4
    assert graphs.replays == {4: 2, 1: 1}
