"""Speculative decoding through the whole service (real Ray, Redis, gRPC, gloo KV channels).

PD: 1 prefill worker and a TP-2 decode group whose rank 0 runs the tiny model as its own
draft (every draft holds, so every decode step verifies a run), with remote prefill forced,
so the decode side speculates on KV that came from the prefill worker. Colocated: two workers
with n-gram lookup. Greedy and seeded output, under a grammar and penalties too, equal the
offline engine's without speculation;
streams cancelled mid-run leave no block held on any worker.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from pdserve.client import Client
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_outputs_params import StructuredOutputsParams
from tests.e2e.harness import running, stats, tiny_settings, wait_until
from tests.integration.test_speculative import repetitive_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, max_tokens=32, seed=5, ignore_eos=True)
# drafts checked against a grammar (a JSON array that repeats itself: drafts find matches)
# and counted by the penalties
ARRAY = {"type": "array", "items": {"enum": [1, 22, 333]}, "minItems": 4, "maxItems": 9}
CONSTRAINED = SamplingParams(temperature=0.8, max_tokens=64, seed=6, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(json=json.dumps(ARRAY)))
PENALIZED = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, presence_penalty=0.5,
                           frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={11: 2.0})


def spec_json(tiny_llama_dir, mode: str) -> str:
    if mode == "pd-tp2-draft":
        return json.dumps({"method": "draft", "model": str(tiny_llama_dir),
                           "num_speculative_tokens": 3})
    return json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})


@pytest.fixture(scope="module", params=["pd-tp2-draft", "colocated-ngram"])
def service(request, ray_cluster, tiny_llama_dir):
    mode = request.param
    settings = tiny_settings(
        tiny_llama_dir, ray_cluster.address, speculative_config=spec_json(tiny_llama_dir, mode),
        **({"decode_tp": 2, "max_local_prefill_tokens": 0} if mode.startswith("pd")
           else {"mode": "colocated", "decode_workers": 2}))
    with running(settings) as service:
        yield service


def counters(address: str) -> tuple[int, int, int]:
    workers = [w for w in stats(address).workers if w.role == "decode"]
    return (sum(w.num_spec_verifications for w in workers),
            sum(w.num_draft_tokens for w in workers),
            sum(w.num_accepted_tokens for w in workers))


def test_outputs_equal_the_offline_engine_without_speculation(service, offline):
    prompts = repetitive_prompts(21, 8)
    params = [GREEDY, SEEDED, CONSTRAINED, PENALIZED] * 2
    expected = [list(o.token_ids) for o in offline.generate(prompts, params)]
    before = counters(service.address)
    with Client(service.address, timeout=120) as client, ThreadPoolExecutor(8) as pool:
        done = list(pool.map(lambda pp: client.complete(pp[0], sampling=pp[1]),
                             zip(prompts, params)))
    assert [list(c.token_ids) for c in done] == expected
    for c in done[2::4]:  # the constrained ones ended with their grammar, valid
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), ARRAY)
    # the load reports that carry the counters lag the streams by up to 0.2 s
    wait_until(lambda: counters(service.address)[2] > before[2], 5, "accepted drafts counted")
    verifications, drafts, accepted = (b - a for a, b in zip(before, counters(service.address)))
    assert verifications > 0 and 0 < accepted <= drafts


def test_cancelled_speculative_streams_free_every_block(service):
    rng = random.Random(3)
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    with Client(service.address, timeout=120) as client:
        for prompt in repetitive_prompts(22, 6):
            stream = client.generate(prompt, sampling=params)
            stop_after = rng.randrange(1, 12)
            for i, _ in enumerate(stream):
                if i == stop_after:
                    break
            stream.close()  # cancels the RPC mid-run
    wait_until(lambda: all(w.num_used_blocks == 0 and w.up
                           for w in stats(service.address).workers),
               5, "every worker's blocks free after the cancels")
