"""Real processes over gloo: one prefill worker, one decode group of TP 1 or 2.

Greedy tokens equal the single engine's for 16+ concurrent requests (prefill prefix-cache hits
included, LoRA adapters on some); a prefill killed mid-push fails only its requests, within
their deadline, and the decode group frees their blocks and keeps serving; an unfed
reservation is reclaimed."""

from __future__ import annotations

import dataclasses
import time

import pytest

from pdserve.engine.engine_core import EngineCore
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.sampling_params import SamplingParams
from tests.integration.hf_reference import mixed_prompts
from tests.workers.pd import engine_config, run_engine
from tests.workers.processes import params_json, spawn_prefill, start_decode_group, wait_ready
from tests.workers.test_loopback_pd import single_engine

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=[2])
def decode_group(tiny_llama_dir, request):
    """Rank 0 of a decode group of `request.param` processes, one group per size for the module
    (a group takes ~5 s to start): every case uses its own request ids and ends asserting that
    the group holds no block, so the next case finds it as new."""
    hosts = start_decode_group(tiny_llama_dir, tp_size=request.param)
    yield hosts[0]
    for host in hosts:  # rank 0's close stops the followers too
        host.stop()


def reserve(decode, prefill, rid, prompt, params, ttl=60.0, lora=None):
    reply = decode.call("reserve", id=rid, prompt=prompt, params=params_json(params),
                        source=prefill.source, deadline=time.time() + ttl, lora=lora)
    assert reply.get("descriptor"), reply
    return reply["descriptor"]


def run_batch(prefill, decode, ids, prompts, params, loras=None):
    """Reserve all, prefill all concurrently, start all; returns the first tokens (or errors).
    `loras`: each request's LoRA adapter (a LoRARequest's fields; None: the base model)."""
    loras = loras or [None] * len(ids)
    descriptors = {rid: reserve(decode, prefill, rid, p, params, lora=lora)
                   for rid, p, lora in zip(ids, prompts, loras)}
    for rid, prompt, lora in zip(ids, prompts, loras):
        assert prefill.call("prefill", id=rid, prompt=prompt, params=params_json(params),
                            descriptor=descriptors[rid], lora=lora)["ok"]
    firsts = {rid: prefill.call("result", id=rid) for rid in ids}
    for rid, reply in firsts.items():
        if "first_token" in reply:
            decode.call("start", id=rid, first_token=reply["first_token"])
    return firsts


def assert_all_free(host):
    stats = host.call("stats")
    assert stats["num_free_blocks"] == stats["num_blocks"], stats


@pytest.mark.parametrize("decode_group", [1, 2], indirect=True)
def test_decode_group_matches_single_engine(tiny_llama_dir, tiny_lora_dirs, decode_group):
    """With LoRA adapters on some requests (two per step at most, of three): each prompt's
    KV computed with its adapter on the prefill worker, decoded with it on every rank."""
    base = [list(p) for p in mixed_prompts(49152, seed=6)]
    prompts = base + [base[0][:160] + [5, 6], base[5][:120]] * 4
    adapters = [None, *(LoRARequest(n, i, str(p))
                        for i, (n, p) in enumerate(sorted(tiny_lora_dirs.items()), 1))]
    loras = [adapters[i % len(adapters)] for i in range(len(prompts))]
    prefill = spawn_prefill(tiny_llama_dir)  # starts while this process computes `expected`
    try:
        expected = run_engine(EngineCore(engine_config(tiny_llama_dir)), prompts, PARAMS, loras)
        ids = [f"r{i}" for i in range(len(prompts))]
        firsts = run_batch(wait_ready(prefill), decode_group, ids, prompts, PARAMS,
                           [dataclasses.asdict(a) if a else None for a in loras])
        assert all("first_token" in r for r in firsts.values()), firsts
        replies = [decode_group.call("collect", id=rid) for rid in ids]
        assert all("tokens" in r for r in replies), replies
        got = [r["tokens"] for r in replies]
        assert got == expected
        stats = prefill.call("stats")
        assert stats["num_computed_tokens"] < sum(len(p) for p in prompts)  # cache hits
        assert stats["num_free_blocks"] == stats["num_blocks"]
        assert_all_free(decode_group)
    finally:
        prefill.stop()


def test_prefill_killed_mid_push_fails_only_its_requests(tiny_llama_dir, decode_group):
    prompts = [list(p) for p in mixed_prompts(49152, seed=7)]
    long_run = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    healthy = spawn_prefill(tiny_llama_dir)
    doomed = spawn_prefill(tiny_llama_dir, die_after_layer_pushes=1)  # both start at once
    try:
        survivors = [f"s{i}" for i in range(3)]
        run_batch(wait_ready(healthy), decode_group, survivors, prompts[:3], long_run)
    except BaseException:
        doomed.stop()
        raise
    finally:
        healthy.stop()
    victims = [f"v{i}" for i in range(3)]
    try:
        wait_ready(doomed)
        descriptors = {
            rid: reserve(decode_group, doomed, rid, p, PARAMS, ttl=20)
            for rid, p in zip(victims, prompts[3:6])
        }
        started = time.time()
        for rid, prompt in zip(victims, prompts[3:6]):
            doomed.send({"op": "prefill", "id": rid, "prompt": prompt,
                         "params": params_json(PARAMS), "descriptor": descriptors[rid]})
        failures = [decode_group.call("collect", id=rid) for rid in victims]
        elapsed = time.time() - started
    finally:
        doomed.stop()
    assert all(f["finish_reason"] == "error" and f["error"] for f in failures), failures
    assert elapsed < 20, f"failures took {elapsed:.1f} s, past the 20 s deadline"
    print(f"decode noticed the dead prefill in {elapsed:.2f} s: {failures[0]['error']}")
    expected = single_engine(tiny_llama_dir, prompts[:3], long_run)
    assert [decode_group.call("collect", id=rid)["tokens"] for rid in survivors] == expected
    assert_all_free(decode_group)


def test_unfed_reservation_is_reclaimed_at_its_deadline(decode_group):
    class Nobody:
        source = ["127.0.0.1", 1, 0]

    reserve(decode_group, Nobody, "lonely", list(range(100, 180)), PARAMS, ttl=1.5)
    stats = decode_group.call("stats")
    assert stats["num_free_blocks"] < stats["num_blocks"] and stats["num_reserved"] == 1
    started = time.time()
    reply = decode_group.call("collect", id="lonely")
    assert reply["finish_reason"] == "error" and "expired" in reply["error"]
    assert time.time() - started < 5
    assert_all_free(decode_group)
