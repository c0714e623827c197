"""Quantized weights through the whole service: a prefill worker and a TP-2 decode group both
serving int4 linears (quantized whole at load, so each rank cuts the same values), remote
prefill forced so the KV crosses workers. Output equals the offline int4 engine's; the model
info and stats report the quantization and the weight bytes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.client import Client
from pdserve.engine.sampling_params import SamplingParams
from pdserve.llm import LLM
from tests.e2e.harness import running, stats, tiny_settings, wait_until
from tests.integration.hf_reference import mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, max_tokens=24, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def service(ray_cluster, tiny_llama_dir):
    settings = tiny_settings(tiny_llama_dir, ray_cluster.address, quantization="int4",
                             decode_tp=2, max_local_prefill_tokens=0)
    with running(settings) as service:
        yield service


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=512, num_kv_blocks=256, num_threads=1,
               quantization="int4")


def test_pd_output_equals_the_offline_int4_engine(service, offline):
    prompts = [list(p)[:300] for p in mixed_prompts(offline.config.model.vocab_size, 17)[:8]]
    params = [GREEDY, SEEDED] * 4
    expected = [list(o.token_ids) for o in offline.generate(prompts, params)]
    with Client(service.address, timeout=120) as client, ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda pp: list(client.complete(pp[0], sampling=pp[1]).token_ids),
                            zip(prompts, params)))
    assert got == expected


def test_model_info_and_stats_report_the_weights(service, offline):
    wait_until(lambda: all(w.weight_bytes for w in stats(service.address).workers), 5,
               "every worker reported its weights")
    with Client(service.address, timeout=30) as client:
        info = client.model_info()
    assert info.quantization == "int4"
    by_role = {w.role: w.weight_bytes for w in stats(service.address).workers}
    assert by_role["prefill"] == offline.weight_bytes  # one whole replica
    assert info.weight_bytes == by_role["decode"] < offline.weight_bytes  # rank 0's shard
