"""Issue 41, prefixes pulled from another decode worker: the workers' side, in this process.

Three real workers over the loopback KV transport (the same sender, receiver and handshake as
gloo): a prefill worker, decode worker A that runs a session's first turn (prefilled remotely,
so A caches the prompt and its output), and decode worker B that gets the second turn. B's
`submit_pulling` reserves blocks for the prefix A holds, A's `push_prefix` sends them, and B
prefills only the rest. Greedy fp32 output equals one engine's, whichever way the prefix came:
pulled, pulled after A lost it (B computes it), never pushed (B gives up at the deadline), or
already held by B (nothing pulled). Counted in B's stats; every block is back in both pools.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from pdserve.decode_worker.worker import DecodeWorker, PrefixGone
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.loopback import LoopbackHub
from pdserve.prefill_worker.worker import PrefillWorker
from tests.workers.pd import MODEL_NAME, SECRET, engine_config, generate_pd, run_engine, streams

BLOCK = 16
TURN1 = list(range(300, 345))  # 45 tokens
NEW = list(range(500, 520))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CALL_S = 60.0


@pytest.fixture
def trio(tiny_llama_dir):
    """(prefill, A, B): A pushes prefixes through its own sender identity."""
    hub = LoopbackHub()
    workers = []
    try:
        prefill = PrefillWorker(engine_config(tiny_llama_dir), hub.connector(
            Endpoint("127.0.0.1", 8, 0), secret=SECRET), MODEL_NAME)
        workers.append(prefill)
        for port in (9, 10):
            ep = Endpoint("127.0.0.1", port, 0)
            workers.append(DecodeWorker(
                engine_config(tiny_llama_dir), hub.listener(ep, secret=SECRET), [ep],
                MODEL_NAME, transport=hub.connector(ep, secret=SECRET)))
        yield tuple(workers)
    finally:
        for worker in workers:
            worker.close()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    core = EngineCore(engine_config(tiny_llama_dir))

    def greedy(prompt: list[int]) -> list[int]:
        return run_engine(core, [prompt], GREEDY)[0]

    return greedy


def first_turn(prefill, a) -> tuple[list[int], int]:
    """Turn 1 on A; (turn 2's prompt, the tokens of it A caches in whole blocks)."""
    out = generate_pd(prefill, a, "turn-1", TURN1, GREEDY)
    history = TURN1 + out
    return history + NEW, (len(history) - 1) // BLOCK * BLOCK  # all but the last token ran


def collect(worker, request_id: str) -> list[int]:
    tokens, last = streams(worker).collect(request_id, CALL_S)
    assert last.finish_reason == "length", last
    return tokens


def cached_kv(worker, tokens: list[int]) -> list[torch.Tensor]:
    """Every layer's K and V of the blocks `worker` caches for the prefix `tokens`."""
    kv = worker.core.kv_cache

    def read() -> list[torch.Tensor]:
        blocks = kv.hold_cached(tokens, None, 0, len(tokens) // BLOCK)
        ids = torch.tensor([b.block_id for b in blocks])
        kv.release_held(blocks)
        return [t[ids].clone() for layer in worker.core.runner.kv_caches for t in layer[:2]]

    return worker._loop.call(read)


def idle(worker) -> bool:
    s = worker.stats()
    return s.num_running == s.num_waiting == s.num_reserved == 0


def assert_all_blocks_free(*workers) -> None:
    for worker in workers:
        deadline = time.monotonic() + 10
        while not (idle(worker) and (s := worker.stats()).num_free_blocks == s.num_blocks):
            assert time.monotonic() < deadline, f"blocks still held: {worker.stats()}"
            time.sleep(0.02)


def test_a_pulled_prefix_is_not_recomputed(trio, reference):
    prefill, a, b = trio
    prompt, held = first_turn(prefill, a)
    computed_before = b.stats().num_computed_tokens
    granted, descriptor = b.submit_pulling("turn-2", prompt, GREEDY, [a.pusher.source], held,
                                           time.time() + CALL_S)
    assert granted and descriptor is not None
    assert (descriptor.first_block, descriptor.num_pushed_blocks) == (0, held // BLOCK)
    seconds = a.push_prefix("turn-2", prompt[:held], None, descriptor)
    assert seconds > 0
    out = collect(b, "turn-2")
    assert out == reference(prompt)
    for mine, theirs in zip(cached_kv(b, prompt[:held]), cached_kv(a, prompt[:held]), strict=True):
        assert torch.equal(mine, theirs)  # every byte of every layer, in its block's place
    stats = b.stats()
    assert (stats.num_pulled_tokens, stats.num_failed_pull_tokens) == (held, 0)
    # B ran the prompt's tail and the decodes, not the pulled prefix
    assert stats.num_computed_tokens - computed_before == len(prompt) - held + len(out) - 1
    assert_all_blocks_free(a, b)
    # the pulled blocks joined B's prefix cache: the same prefix again needs no pull
    granted, descriptor = b.submit_pulling("turn-2b", prompt, GREEDY, [a.pusher.source], held,
                                           time.time() + CALL_S)
    assert granted and descriptor is None
    assert collect(b, "turn-2b") == out
    assert b.stats().num_pulled_tokens == held


def test_a_prefix_the_holder_lost_is_computed_at_once(trio, reference):
    prefill, a, b = trio
    prompt, held = first_turn(prefill, a)
    wrong = [t + 1 for t in prompt[:held]]  # hashes A never cached: as if evicted
    wrong_prompt = wrong + prompt[held:]
    granted, descriptor = b.submit_pulling("turn-2", wrong_prompt, GREEDY, [a.pusher.source],
                                           held, time.time() + CALL_S)
    assert granted and descriptor is not None
    started = time.monotonic()
    with pytest.raises(PrefixGone, match="block 0 of the prefix"):
        a.push_prefix("turn-2", wrong, None, descriptor)
    assert collect(b, "turn-2") == reference(wrong_prompt)
    assert time.monotonic() - started < CALL_S / 2  # told at once, not at the deadline
    stats = b.stats()
    assert (stats.num_pulled_tokens, stats.num_failed_pull_tokens) == (0, held)
    assert_all_blocks_free(a, b)


def test_a_pull_never_pushed_is_given_up_at_its_deadline(trio, reference):
    prefill, a, b = trio
    prompt, held = first_turn(prefill, a)
    granted, descriptor = b.submit_pulling("turn-2", prompt, GREEDY, [a.pusher.source], held,
                                           time.time() + 0.5)
    assert granted and descriptor is not None
    assert collect(b, "turn-2") == reference(prompt)
    assert b.stats().num_failed_pull_tokens == held
    with contextlib.suppress(Exception):  # too late: whatever it sends is dropped
        a.push_prefix("turn-2", prompt[:held], None, descriptor)
    assert_all_blocks_free(a, b)


def test_an_aborted_pull_frees_its_blocks_on_both_workers(trio):
    prefill, a, b = trio
    prompt, held = first_turn(prefill, a)
    granted, descriptor = b.submit_pulling("turn-2", prompt, GREEDY, [a.pusher.source], held,
                                           time.time() + CALL_S)
    assert granted and b.stats().num_reserved == 1
    assert b.abort("turn-2")
    with contextlib.suppress(Exception):  # the receiver drops what it no longer wants
        a.push_prefix("turn-2", prompt[:held], None, descriptor)
    assert_all_blocks_free(a, b)


@pytest.mark.parametrize(("field", "kwargs"), [
    ("num_pull_tokens", {"num_pull_tokens": 20}),  # not whole blocks
    ("num_pull_tokens", {"num_pull_tokens": 0}),
    ("num_pull_tokens", {"num_pull_tokens": 96}),  # the whole prompt: its last token runs here
    ("pull_sources", {"sources": []}),
    ("prompt_logprobs", {"params": SamplingParams(max_tokens=2, prompt_logprobs=1)}),
])
def test_bad_pull_fields_are_refused_holding_nothing(trio, field, kwargs):
    _, a, b = trio
    call = {"request_id": "bad", "prompt_token_ids": list(range(96)), "params": GREEDY,
            "sources": [a.pusher.source], "num_pull_tokens": 32,
            "deadline": time.time() + CALL_S, **kwargs}
    with pytest.raises(ValueError, match=field):
        b.submit_pulling(**call)
    assert_all_blocks_free(b)


def test_a_push_names_its_own_blocks_only(trio):
    prefill, a, b = trio
    prompt, held = first_turn(prefill, a)
    granted, descriptor = b.submit_pulling("turn-2", prompt, GREEDY, [a.pusher.source], held,
                                           time.time() + CALL_S)
    with pytest.raises(ValueError, match="this decode worker is"):
        b.push_prefix("turn-2", prompt[:held], None, descriptor)  # B is not the source
    with pytest.raises(ValueError, match="prompt_token_ids has"):
        a.push_prefix("turn-2", prompt[:held - BLOCK], None, descriptor)
    with pytest.raises(ValueError, match="descriptor is for request"):
        a.push_prefix("other", prompt[:held], None, descriptor)
    b.abort("turn-2")
    assert_all_blocks_free(a, b)
