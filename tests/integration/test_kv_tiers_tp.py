"""KV tiers on a tensor-parallel group of 2 real processes (gloo): each rank writes its KV-head
shard of a block to its own host slots and its own disk files, every copy is reported only once
both ranks have it, and a prefix that comes back from host or disk gives the tokens a
single-process engine without tiers gives (fp32 greedy). No device block is left held."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import traceback

import torch
import torch.distributed as dist

from pdserve.engine.config import CacheConfig, EngineConfig, load_model_config
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.plan_broadcast import follow
from pdserve.engine.request import Request
from tests.integration.test_kv_tiers import BLOCK, GREEDY, POOL, PROMPTS, block_bytes
from tests.integration.test_tensor_parallel import free_port


def config(model_dir, **tiers) -> EngineConfig:
    return EngineConfig(model=load_model_config(model_dir, max_model_len=256),
                        cache=CacheConfig(block_size=BLOCK, num_blocks=POOL, **tiers),
                        num_threads=1)


def core_turns(core: EngineCore, rounds: int) -> list[tuple[list[int], int]]:
    """test_kv_tiers.turns on an EngineCore: each prompt alone, a token longer each round."""
    out = []
    for r in range(rounds):
        for i, prompt in enumerate(PROMPTS):
            core.add_request(Request(f"{r}-{i}", tuple(prompt + [5] * r), GREEDY))
            tokens, cached = [], 0
            while core.has_unfinished_requests():
                for o in core.step():
                    tokens += o.new_token_ids
                    cached = o.num_cached_tokens
            out.append((tokens, cached))
    return out


def rank_main(rank: int, port: int, model_dir, tiers: dict, results) -> None:
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, None, rank == 0, wait_for_workers=False)
        group = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, 2,
                                      datetime.timedelta(seconds=60))
        tp = TensorParallel(rank, 2, group)
        core = EngineCore(config(model_dir, **tiers), tp)
        if rank == 1:
            follow(core.runner, tp)
            return
        got = core_turns(core, 2)
        t = core.kv_cache.tiers
        results.put(("ok", got, t.stats.host_hits, t.stats.promotions, t.busy,
                     core.kv_cache.num_free_blocks))
        core.shutdown()
    except BaseException:
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def test_a_tp2_group_tiers_each_ranks_shard(tiny_llama_dir, tmp_path):
    cold = core_turns(EngineCore(config(tiny_llama_dir)), 2)
    # host: 3 whole blocks (6 of each rank's half-blocks), so most blocks go on to disk
    tiers = dict(kv_host_bytes=3 * block_bytes(tiny_llama_dir), kv_disk_path=str(tmp_path),
                 kv_disk_bytes=64 * block_bytes(tiny_llama_dir))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, tiny_llama_dir, tiers, results))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        status, *payload = results.get(timeout=180)
        assert status == "ok", payload[0]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    got, host_hits, promotions, busy, free = payload
    assert [t for t, _ in got] == [t for t, _ in cold]
    assert [c for _, c in cold[5:]] == [0] * 5  # the device alone kept none of them
    assert all(c == 96 for _, c in got[5:])  # every full prompt block came from a tier
    assert host_hits == 5 * 6 and promotions > 0
    assert not busy and free == POOL
    dirs = [d for d in tmp_path.iterdir() if d.is_dir()]  # one per rank's layout id
    assert len(dirs) == 2 and all(any(d.glob("*.kv")) for d in dirs)
