"""A tensor-parallel group of 2 real processes (gloo) gives the single-process tokens.

Each rank holds half the heads, half the MLP and half the vocabulary; rank 0 schedules and
broadcasts the plan, both execute it. The group is built from a rendezvous store with no
global world, as decode groups are in production.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import socket
import traceback

import pytest
import torch
import torch.distributed as dist

from pdserve.engine.config import CacheConfig, EngineConfig, load_model_config
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.kv_tiers import TierOps
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.plan_broadcast import decode_plan, encode_plan, follow
from pdserve.engine.sampling_params import SamplingParams
from tests.integration.hf_reference import mixed_prompts
from tests.workers.pd import run_engine

MAX_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_config(model_dir, quantization=None) -> EngineConfig:
    return EngineConfig(
        model=load_model_config(model_dir, max_model_len=512, quantization=quantization),
        cache=CacheConfig(block_size=16, num_blocks=128),
        num_threads=1,
    )


def run_requests(core: EngineCore, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return run_engine(core, prompts, params)


def tp_rank_main(rank, size, port, model_dir, prompts, results, quantization=None,
                 expert_parallel=False):
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, None, rank == 0, wait_for_workers=False)
        timeout = datetime.timedelta(seconds=60)
        group = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, size, timeout)
        tp = TensorParallel(rank, size, group, expert_parallel)
        core = EngineCore(make_config(model_dir, quantization), tp)
        if rank == 0:
            results.put(("ok", run_requests(core, prompts)))
            core.shutdown()
        else:
            follow(core.runner, tp)
    except BaseException:
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def test_plan_codec_round_trip():
    from pdserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput

    plan = SchedulerOutput(
        (
            ScheduledRequest("a", (5,), 17, (3, 9), SamplingParams(temperature=0.5, stop=["x"])),
            ScheduledRequest("b", (1, 2, 3), 0, (4,), None),
        ),
        ("gone",),
    )
    assert decode_plan(json.loads(json.dumps(encode_plan(plan)))) == plan
    h1, h2 = b"\x01" * 16, b"\xfe" * 16
    ops = TierOps(loads=((3, 7),), demotions=((1, h1, (5, 6)),), stores=((8, 2),),
                  promotions=((h2, (9,), 4),), deletes=(h1, h2))
    with_tiers = SchedulerOutput(plan.requests, (), ops)  # every rank copies its shard
    assert decode_plan(json.loads(json.dumps(encode_plan(with_tiers)))) == with_tiers


def run_group(model_dir, prompts, tp_size=2, quantization=None, expert_parallel=False):
    """The tokens rank 0 of a `tp_size` group of real processes returns."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=tp_rank_main, args=(r, tp_size, port, model_dir, prompts, results,
                                               quantization, expert_parallel))
        for r in range(tp_size)
    ]
    for p in procs:
        p.start()
    try:
        status, payload = results.get(timeout=180)
        assert status == "ok", payload
        return payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


@pytest.mark.parametrize("quantization", ["int4"])  # quantized whole (groups), then cut
def test_tp_group_matches_single_process(tiny_llama_dir, quantization):
    prompts = [list(p) for p in mixed_prompts(49152, seed=3)[:6]]
    expected = run_requests(EngineCore(make_config(tiny_llama_dir, quantization)), prompts)
    assert run_group(tiny_llama_dir, prompts, quantization=quantization) == expected
