"""The KV tiers on a real (tiny) model: a prefix that comes back from host memory or disk gives
the tokens a cold run gives (fp32 greedy), bad disk files are misses, a restarted engine
re-indexes its disk, and no device block is left held."""

from __future__ import annotations

import random
import threading

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.config import load_model_config

GREEDY = SamplingParams(temperature=0, max_tokens=6)
BLOCK = 16
POOL = 16  # device blocks: one 256-token context, a fraction of the working set
PROMPTS = [random.Random(i).choices(range(3, 30000), k=97) for i in range(5)]  # 6 blocks each


def engine(model_dir, **kw) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", num_kv_blocks=POOL, max_model_len=256,
               num_threads=2, **kw)


def block_bytes(model_dir, cache_dtype: str = "auto") -> int:
    return BLOCK * load_model_config(model_dir, "float32").kv_bytes_per_token(cache_dtype)


def turns(llm: LLM, rounds: int) -> list[tuple[list[int], int]]:
    """Each prompt once per round, one at a time, growing by a token a round: a later round's
    prefix was evicted from the device pool by the other prompts in between."""
    out = []
    for r in range(rounds):
        for prompt in PROMPTS:
            (o,) = llm.generate([prompt + [5] * r], GREEDY)
            out.append((o.token_ids, o.num_cached_tokens))
    return out


def assert_idle(llm: LLM) -> None:
    core = llm.engine.core
    assert core.kv_cache.num_free_blocks == POOL
    assert not core.kv_cache.tiers.busy


@pytest.fixture(scope="module")
def cold(tiny_llama_dir):
    return turns(engine(tiny_llama_dir), 2)


def test_host_tier_hits_give_the_cold_tokens(tiny_llama_dir, cold):
    llm = engine(tiny_llama_dir, kv_host_bytes=64 * block_bytes(tiny_llama_dir))
    got = turns(llm, 2)
    assert [t for t, _ in got] == [t for t, _ in cold]
    assert [c for _, c in cold[5:]] == [0] * 5  # the device alone kept none of them
    assert [c for _, c in got[5:]] == [96] * 5  # every full prompt block came from host
    assert llm.engine.core.kv_cache.tiers.stats.host_hits == 5 * 6
    assert_idle(llm)


def test_disk_tier_hits_corruption_and_restart(tiny_llama_dir, cold, tmp_path):
    disk = dict(kv_host_bytes=4 * block_bytes(tiny_llama_dir), kv_disk_path=str(tmp_path),
                kv_disk_bytes=64 * (block_bytes(tiny_llama_dir) + 4096))
    llm = engine(tiny_llama_dir, **disk)
    got = turns(llm, 2)
    tiers = llm.engine.core.kv_cache.tiers
    assert [t for t, _ in got] == [t for t, _ in cold]
    assert tiers.stats.disk_hits > 0 and all(c >= 64 for _, c in got[5:])
    assert_idle(llm)
    llm.engine.core.shutdown()

    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) == tiers.num_disk_blocks_held
    for i, path in enumerate(files):  # every file torn or corrupt, each its own way
        data = bytearray(path.read_bytes())
        path.write_bytes(data[: len(data) // 2] if i % 2 else data[:-1] + bytes([data[-1] ^ 1]))
    restarted = engine(tiny_llama_dir, **disk)  # re-indexing drops the torn files at once
    assert restarted.engine.core.kv_cache.tiers.num_disk_blocks_held == (len(files) + 1) // 2
    again = turns(restarted, 1)
    assert [t for t, _ in again] == [t for t, _ in cold[:5]]
    stats = restarted.engine.core.kv_cache.tiers.stats
    assert stats.promotions == 0 and stats.failed_promotions > 0
    assert_idle(restarted)

    fresh = engine(tiny_llama_dir, **disk)  # a restart over good files: hits from disk
    assert [t for t, _ in turns(fresh, 2)][5:] == [t for t, _ in cold[5:]]
    assert fresh.engine.core.kv_cache.tiers.stats.promotions > 0


def test_int8_cache_blocks_round_trip_with_their_scales(tiny_llama_dir):
    kw = dict(kv_cache_dtype="int8")
    cold = turns(engine(tiny_llama_dir, **kw), 2)
    llm = engine(tiny_llama_dir, kv_host_bytes=64 * block_bytes(tiny_llama_dir, "int8"), **kw)
    got = turns(llm, 2)
    assert [t for t, _ in got] == [t for t, _ in cold]
    assert [c for _, c in got[5:]] == [96] * 5
    assert_idle(llm)


def test_tiers_refuse_what_they_cannot_serve(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="kv_host_bytes"):
        engine(tiny_llama_dir, kv_host_bytes=10)
    with pytest.raises(ValueError, match="kv_disk_path"):
        engine(tiny_llama_dir, kv_host_bytes=1 << 20, kv_disk_path=str(tmp_path))
    with pytest.raises(ValueError, match="kv_host_bytes"):
        engine(tiny_llama_dir, kv_disk_path=str(tmp_path), kv_disk_bytes=1 << 20)


def test_a_failing_copy_thread_costs_hits_not_tokens_or_blocks(tiny_llama_dir, cold, monkeypatch):
    from pdserve.engine.kv_offload import KVOffload

    def broken(self, slot, block_id, to_device):
        raise RuntimeError("copy failed")

    llm = engine(tiny_llama_dir, kv_host_bytes=64 * block_bytes(tiny_llama_dir))
    monkeypatch.setattr(KVOffload, "_copy", broken)
    got = turns(llm, 2)
    assert [t for t, _ in got] == [t for t, _ in cold]
    assert llm.engine.core.kv_cache.tiers.num_host_blocks == 0
    assert_idle(llm)


def test_an_abort_between_steps_leaves_no_block_held_once_the_loop_steps(tiny_llama_dir):
    llm = engine(tiny_llama_dir, kv_host_bytes=64 * block_bytes(tiny_llama_dir))
    engine_ = llm.engine
    engine_.add_prepared(engine_.prepare("a", PROMPTS[0], SamplingParams(max_tokens=50)))
    engine_.step()  # the prompt's blocks are published, their stores queued
    engine_.abort("a")
    assert llm.engine.core.kv_cache.num_free_blocks == POOL - 6  # held for their copies
    assert engine_.has_unfinished_requests()  # so the owner's loop steps on
    while engine_.has_unfinished_requests():
        engine_.step()
    assert_idle(llm)


def test_loads_land_layer_by_layer_beside_the_forward(tiny_llama_dir, cold, monkeypatch):
    # layer 1's loads may only start once layer 0 has computed: a step that waited for every
    # layer's loads before its first layer would never get there (the gate times out)
    from pdserve.engine.kv_offload import KVOffload

    llm = engine(tiny_llama_dir, kv_host_bytes=64 * block_bytes(tiny_llama_dir))
    layer0 = llm.engine.core.runner.model.layers[0]
    computed = threading.Event()
    forward = layer0.forward

    def first_layer(*args, **kwargs):
        out = forward(*args, **kwargs)
        computed.set()
        return out

    copy, load = KVOffload._copy, KVOffload._load
    per_layer = len(llm.engine.core.runner.kv_caches[0])

    def step_loads(self, *args):
        computed.clear()  # layer 0 of this step has not run: it waits for this step's loads
        load(self, *args)

    def gated(self, slot, block_id, to_device, parts=None):
        if to_device and parts is not None and parts[0] >= per_layer:  # layer 1 on
            assert computed.wait(10), "a later layer's loads ran before layer 0 computed"
        copy(self, slot, block_id, to_device, parts)

    monkeypatch.setattr(layer0, "forward", first_layer)
    monkeypatch.setattr(KVOffload, "_load", step_loads)
    monkeypatch.setattr(KVOffload, "_copy", gated)
    got = turns(llm, 2)
    assert [t for t, _ in got] == [t for t, _ in cold]
    assert [c for _, c in got[5:]] == [96] * 5  # every full prompt block loaded from host
    assert_idle(llm)


def test_a_failed_load_fails_its_step_not_its_tokens(tiny_llama_dir, monkeypatch):
    from pdserve.engine.kv_offload import KVOffload

    llm = engine(tiny_llama_dir, kv_host_bytes=64 * block_bytes(tiny_llama_dir))
    turns(llm, 1)  # host holds every prompt's blocks now
    copy = KVOffload._copy

    def broken_load(self, slot, block_id, to_device, parts=None):
        if to_device:
            raise RuntimeError("host memory unreadable")
        copy(self, slot, block_id, to_device, parts)

    monkeypatch.setattr(KVOffload, "_copy", broken_load)
    with pytest.raises(RuntimeError, match="KV tier loads failed: host memory unreadable"):
        llm.generate([PROMPTS[0] + [5]], GREEDY)
