"""Prefill and decode workers in one process over the loopback transport: greedy tokens
identical to the single engine, prefix-cache hits on the prefill side, clean accounting."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import load_model_config
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.loopback import LoopbackHub
from pdserve.prefill_worker.worker import PrefillWorker
from tests.integration.hf_reference import mixed_prompts
from tests.workers.pd import (
    MODEL_NAME,
    SECRET,
    engine_config,
    generate_pd,
    loopback_pair,
    run_engine,
)

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def single_engine(model_dir, prompts, params=PARAMS):
    return run_engine(EngineCore(engine_config(model_dir)), prompts, params)


@pytest.fixture()
def workers(tiny_llama_dir):
    with loopback_pair(tiny_llama_dir) as pair:
        yield pair


def test_disaggregated_matches_single_engine(tiny_llama_dir, workers):
    prefill, decode = workers
    base = [list(p) for p in mixed_prompts(49152, seed=5)]
    prompts = base + [base[0][:200] + [7, 8, 9], base[2][:100]] * 4  # prefix-cache hits
    expected = single_engine(tiny_llama_dir, prompts)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(
            lambda i: generate_pd(prefill, decode, f"r{i}", prompts[i], PARAMS),
            range(len(prompts)),
        ))
    assert got == expected
    assert prefill.stats().num_computed_tokens < sum(len(p) for p in prompts)
    stats = decode.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert prefill.stats().num_free_blocks == prefill.stats().num_blocks


@pytest.mark.parametrize("mismatch", ["block_size", "dtype", "head_split"])
def test_layout_mismatch_fails_before_any_transfer(tiny_llama_dir, mismatch):
    """The prefill refuses a descriptor of another layout; no KV byte moves; nothing leaks."""
    import dataclasses

    from pdserve.engine.config import CacheConfig
    from pdserve.kvtransfer.descriptor import TransferDescriptor

    hub = LoopbackHub()
    decode_ep = Endpoint("127.0.0.1", 9, 0)
    decode = DecodeWorker(engine_config(tiny_llama_dir), hub.listener(decode_ep, secret=SECRET),
                          [decode_ep], MODEL_NAME)
    config = engine_config(tiny_llama_dir)
    if mismatch == "block_size":
        config = dataclasses.replace(config, cache=CacheConfig(block_size=32, num_blocks=128))
    if mismatch == "dtype":
        config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, dtype="bfloat16")
        )
    prefill = PrefillWorker(config, hub.connector(Endpoint("127.0.0.1", 8, 0), secret=SECRET),
                            MODEL_NAME)
    try:
        prompt = list(range(100, 164))
        desc = decode.reserve("m", prompt, PARAMS, [prefill.endpoint], 1e12)
        assert desc is not None
        if mismatch == "head_split":  # a descriptor that splits the KV heads over 2 ranks
            split = TransferDescriptor.new(
                "h", decode.layout, [prefill.endpoint],
                [(decode_ep, desc.destinations[0].block_ids),
                 (Endpoint("127.0.0.1", 9, 1), desc.destinations[0].block_ids)], 1e12,
            )
            with pytest.raises(ValueError, match="heads"):
                decode.connector.receiver.expect(split)
        else:
            with pytest.raises(ValueError, match="layout"):
                prefill.prefill("m", prompt, PARAMS, desc)
        assert decode.abort("m")
        assert prefill.stats().num_free_blocks == prefill.stats().num_blocks
        stats = decode.stats()
        assert stats.num_free_blocks == stats.num_blocks
    finally:
        prefill.close()
        decode.close()


def test_seeded_sampling_continues_across_prefill_and_decode(tiny_llama_dir, workers):
    """The prefill worker samples the first token from the seed's stream; decode picks the
    stream up where it left off, so seeded outputs equal the colocated engine's."""
    prefill, decode = workers
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=77, max_tokens=10, ignore_eos=True)
    prompts = [list(range(200, 230)), list(range(300, 305))]
    expected = single_engine(tiny_llama_dir, prompts, params)
    got = [generate_pd(prefill, decode, f"s{i}", p, params) for i, p in enumerate(prompts)]
    assert got == expected


def test_prefixes_come_back_from_host_and_disk_tiers_on_both_sides(tiny_llama_dir, tmp_path):
    """A prefill worker whose device pool cannot keep the prompts' prefixes gets them back
    from its host and disk tiers, and a decode worker's reservation takes them from its host
    tier (so they are not pushed again): the tokens are the single engine's, fewer are
    computed, and no block is left held on either side."""
    import dataclasses
    import random

    from pdserve.engine.config import CacheConfig

    base = [random.Random(i).choices(range(3, 40000), k=200) for i in range(4)]
    prompts = base + [p + [7, 8] for p in base]  # each prefix again, after the others
    expected = single_engine(tiny_llama_dir, prompts)
    block_bytes = 16 * load_model_config(tiny_llama_dir).kv_bytes_per_token()
    config = dataclasses.replace(engine_config(tiny_llama_dir), cache=CacheConfig(
        num_blocks=32, kv_host_bytes=16 * block_bytes, kv_disk_path=str(tmp_path),
        kv_disk_bytes=64 * (block_bytes + 4096)))
    decode_config = dataclasses.replace(engine_config(tiny_llama_dir), cache=CacheConfig(
        num_blocks=32, kv_host_bytes=64 * block_bytes))
    hub = LoopbackHub()
    decode_ep = Endpoint("127.0.0.1", 9, 0)
    decode = DecodeWorker(decode_config, hub.listener(decode_ep, secret=SECRET),
                          [decode_ep], MODEL_NAME)
    prefill = PrefillWorker(config, hub.connector(Endpoint("127.0.0.1", 8, 0), secret=SECRET),
                            MODEL_NAME)
    try:
        got = [generate_pd(prefill, decode, f"t{i}", p, PARAMS) for i, p in enumerate(prompts)]
        assert got == expected
        tiers = prefill.core.kv_cache.tiers.stats
        assert tiers.host_hits == 4 * 12 and tiers.disk_hits > 0  # every full prompt block
        assert prefill.stats().num_computed_tokens == sum(map(len, prompts)) - 4 * 12 * 16
        assert decode.core.kv_cache.tiers.stats.host_hits == 4 * 12  # reserved from host
        for stats in (prefill.stats(), decode.stats()):
            assert stats.num_free_blocks == stats.num_blocks
    finally:
        prefill.close()
        decode.close()
