"""Colocated mode through the same router: two workers that prefill and decode in one engine."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.client import Client
from pdserve.engine.sampling_params import SamplingParams
from tests.e2e.harness import health, running, stats, tiny_settings, wait_until
from tests.integration.hf_reference import mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def service(ray_cluster, tiny_llama_dir):
    with running(tiny_settings(tiny_llama_dir, ray_cluster.address, mode="colocated",
                               decode_workers=2)) as service:
        yield service


def test_colocated_serves_the_offline_engines_tokens_on_both_workers(service, offline):
    prompts = [list(p)[:300] for p in mixed_prompts(offline.config.model.vocab_size, seed=5)]
    expected = [list(o.token_ids) for o in offline.generate(prompts, GREEDY)]
    assert health(service.address) == "SERVING"
    assert {w.role for w in stats(service.address).workers} == {"decode"}  # no prefill pool
    with Client(service.address, timeout=120) as client, ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: list(client.complete(p, sampling=GREEDY).token_ids),
                            prompts))
    assert got == expected
    # concurrent requests spread over both workers, and each prefilled its own prompts; the
    # router's load snapshot lags by <= 0.2 s, and the tiny model may finish inside that lag
    wait_until(lambda: (c := [w.num_cached_blocks for w in stats(service.address).workers
                              if w.num_used_blocks == 0]) and len(c) == 2 and all(c),
               5, "both workers idle, each holding cached blocks of its own prompts")
