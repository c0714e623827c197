"""Failures inside a prefill step, over the loopback transport: a push that fails fails only
its requests, a forward that raises tells the decode side at once, the workers go on, and
every block is free on both sides afterwards."""

from __future__ import annotations

import time

import pytest

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.loopback import LoopbackHub
from pdserve.prefill_worker.worker import PrefillWorker
from tests.workers.pd import MODEL_NAME, SECRET, engine_config, generate_pd, streams
from tests.workers.test_loopback_pd import PARAMS, single_engine


def decode_at(hub, model_dir, port):
    ep = Endpoint("127.0.0.1", port, 0)
    return DecodeWorker(engine_config(model_dir), hub.listener(ep, secret=SECRET), [ep],
                        MODEL_NAME)


def assert_all_free(*workers):
    for worker in workers:
        stats = worker.stats()
        assert stats.num_free_blocks == stats.num_blocks, stats


@pytest.fixture()
def hub_workers(tiny_llama_dir):
    hub = LoopbackHub()
    decode = decode_at(hub, tiny_llama_dir, 9)
    prefill = PrefillWorker(engine_config(tiny_llama_dir),
                            hub.connector(Endpoint("127.0.0.1", 8, 0), secret=SECRET),
                            MODEL_NAME)
    yield hub, prefill, decode
    prefill.close()
    decode.close()


def test_a_failed_push_fails_only_its_requests(tiny_llama_dir, hub_workers):
    hub, prefill, decode = hub_workers
    gone = decode_at(hub, tiny_llama_dir, 10)
    prompts = [list(range(100, 150)), list(range(200, 240))]
    deadline = time.time() + 60
    good = decode.reserve("good", prompts[0], PARAMS, [prefill.endpoint], deadline)
    lost = gone.reserve("lost", prompts[1], PARAMS, [prefill.endpoint], deadline)
    gone.close()  # nobody listens there any more: that push fails at its first layer
    futures = [prefill.prefill("good", prompts[0], PARAMS, good),
               prefill.prefill("lost", prompts[1], PARAMS, lost)]
    with pytest.raises(RuntimeError, match="PEER_LOST"):
        futures[1].result(timeout=30)
    first = futures[0].result(timeout=30)
    assert first.transfer_bytes > 0
    decode.start("good", first.first_token, first.logprobs)
    tokens, last = streams(decode).collect("good")
    assert tokens == single_engine(tiny_llama_dir, prompts[:1])[0] and last.error is None
    assert_all_free(prefill, decode)


def test_a_failed_forward_fails_its_requests_and_tells_decode(tiny_llama_dir, hub_workers):
    _, prefill, decode = hub_workers
    prompt = list(range(300, 364))
    descriptor = decode.reserve("doomed", prompt, PARAMS, [prefill.endpoint], time.time() + 60)
    save = prefill.connector.save_kv_layer

    def save_then_fail(layer: int) -> None:  # the tiny model has 2 layers: 1 never goes
        save(layer)
        if layer == 0:
            raise RuntimeError("layer 1 fell over")

    prefill.connector.save_kv_layer = save_then_fail
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="fell over"):
            prefill.prefill("doomed", prompt, PARAMS, descriptor).result(timeout=30)
        _, last = streams(decode).collect("doomed", timeout=30)
        assert last.finish_reason == "error" and "PREFILL_FAILED" in last.error
        assert time.monotonic() - started < 10  # told at once, not at the 60 s deadline
    finally:
        del prefill.connector.save_kv_layer
    assert prefill.is_alive() and decode.is_alive()
    assert_all_free(prefill, decode)
    again = generate_pd(prefill, decode, "again", prompt, PARAMS)  # both go on serving
    assert again == single_engine(tiny_llama_dir, [prompt])[0]
    assert_all_free(prefill, decode)


def test_a_dead_decode_loop_ends_every_stream_with_the_reason(tiny_llama_dir, hub_workers):
    _, prefill, decode = hub_workers
    long_run = type(PARAMS)(temperature=0, max_tokens=400, ignore_eos=True)
    assert decode.submit("running", list(range(10, 40)), long_run)
    descriptor = decode.reserve("reserved", list(range(50, 90)), long_run, [prefill.endpoint],
                                time.time() + 60)
    assert descriptor is not None
    runner_execute = decode.core.runner.execute

    def execute(plan):
        if plan.requests and plan.requests[0].num_computed_tokens > 35:
            raise RuntimeError("the accelerator fell off the bus")
        return runner_execute(plan)

    decode.core.runner.execute = execute
    for rid in ("running", "reserved"):
        _, last = streams(decode).collect(rid, timeout=30)
        assert last.finish_reason == "error" and "fell off the bus" in last.error
    assert not decode.is_alive()
    with pytest.raises(RuntimeError, match="died"):
        decode.submit("after", list(range(10, 40)), long_run)
    stats = decode.stats()  # read directly once the loop is gone: every block was freed
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0, stats
