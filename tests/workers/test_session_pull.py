"""Issue 41's acceptance: a session's turn that lands on the decode worker not holding its prefix
pulls that prefix from the one that does, instead of recomputing it.

Real services in this process: one prefill and two decode workers (one sequence each) behind
their authenticated gRPC servers, KV over gloo on 127.0.0.1, a real redis-server holding the
session, and the real Router. Turn 1 runs on one decode worker (the holder). Then a
reservation nobody feeds takes the holder's only sequence slot, so turn 2 must go to the other
worker: the router has it pull the prefix the holder caches (no pull was measured yet, so one
is tried), the holder pushes it, the other prefills the rest. Counted three ways: the router's
pull counters (one pulled, its bytes the layout's bytes of those blocks), the puller's pulled
tokens, and the tokens each worker computed (the prefill worker none for turn 2, the puller
only the prompt's tail). Greedy output of both turns equals the offline engine's, and every
block is back in every pool afterwards. Again with a TP-2 decode group (rank 1 in its own
process) as the puller: the single-rank holder pushes each rank its KV-head shard. And with the
holder's prefix cache emptied before turn 2: the holder says so, the pull counts as missed, and
the puller computes the whole prompt, with the same tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.proto import worker_pb2
from pdserve.redis_keys import scoped_session_id
from pdserve.router.auth import tenant_of
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.router import Router
from pdserve.router.store import RedisStore
from pdserve.router.validation import ModelContext, ValidRequest
from tests.faults.worker_plane import (
    decode_stub,
    decode_tp2,
    sampling,
    source_of,
    worker_spec,
)
from tests.workers.pd import SECRET
from tests.workers.test_session_skip_held import (
    _collect,
    _session,
    block_nbytes,
    counter,
    two_decode_plane,
)

AUTH = SECRET.grpc_metadata()
CALL_S = 60.0
BLOCK = 16
TURN1 = 70  # tokens; each test its own, so no worker caches another test's turns
NEW = 30
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def plane(tiny_llama_dir):
    with two_decode_plane(tiny_llama_dir, max_num_seqs=1) as workers:
        yield workers


@contextlib.contextmanager
def slot_taken(prefill, service):
    """A reservation that is never fed: the worker's one sequence slot, until it ends."""
    channel, stub = decode_stub(service.address)
    try:
        reply = stub.Reserve(worker_pb2.ReserveRequest(
            request_id="blocker", prompt_token_ids=list(range(40)), sampling=sampling(),
            sources=[source_of(prefill)], deadline=time.time() + CALL_S, router_id="blocker"),
            metadata=AUTH, timeout=CALL_S)
        assert reply.granted
        yield
    finally:
        stub.Abort(worker_pb2.WorkerAbortRequest(request_id="blocker"), metadata=AUTH,
                   timeout=CALL_S)
        channel.close()


async def wait_load(router: Router, worker: str, ready) -> None:
    """Until the router's last load report of `worker` satisfies `ready` (bounded)."""
    end = time.monotonic() + 10.0
    while (load := router.decode[worker].load) is None or not ready(load):
        assert time.monotonic() < end, f"{worker}'s load never showed it: {load}"
        await asyncio.sleep(0.05)


async def serve(model, plane, redis_server, metrics, first, late=None, lose_prefix=False):
    """Both turns; `late`: decode workers registered only after turn 1 (so it ran elsewhere);
    `lose_prefix`: the holder's prefix cache is emptied before turn 2 (as by evictions).
    Turn 1's prompt is TURN1 tokens from `first` on, turn 2 adds NEW more after its output."""
    turn1 = list(range(first, first + TURN1))
    prefill, decodes = plane
    store = RedisStore(redis_server.url, namespace="pull", timeout_s=2.0)
    router = Router(model, RouterConfig(prefill_placement="fixed"), metrics, store,
                    secret=SECRET)
    session_id = scoped_session_id(tenant_of("alpha"), f"chat-{first}")
    try:
        await router.add_worker("prefill-0", "prefill", prefill.address)
        for name, service in decodes.items():
            await router.add_worker(name, "decode", service.address)
        await router.wait_ready(CALL_S)
        req = ValidRequest("turn-1", tuple(turn1), GREEDY, session_id)
        out1 = [t for m in await asyncio.wait_for(_collect(router, req), CALL_S)
                for t in m.token_ids]
        holder = (await _session(store, session_id, turn1 + out1)).decode_worker
        for name, service in (late or {}).items():
            await router.add_worker(name, "decode", service.address)
        await router.wait_ready(CALL_S)
        decodes = decodes | (late or {})
        other = next(name for name in decodes if name != holder)
        prompt2 = turn1 + out1 + list(range(first + 5000, first + 5000 + NEW))
        computed = {name: s.worker.stats().num_computed_tokens for name, s in decodes.items()}
        before = decodes[other].worker.stats()
        prefill_computed = prefill.worker.stats().num_computed_tokens
        if lose_prefix:
            worker = decodes[holder].worker
            worker._loop.call(worker.core.kv_cache.pool.reset_prefix_cache)
        with slot_taken(prefill, decodes[holder]):
            await wait_load(router, holder, lambda load: load.num_waiting == 1)
            req = ValidRequest("turn-2", tuple(prompt2), GREEDY, session_id)
            out2 = [t for m in await asyncio.wait_for(_collect(router, req), CALL_S)
                    for t in m.token_ids]
        session = await _session(store, session_id, prompt2 + out2)
        stats = {name: service.worker.stats() for name, service in decodes.items()}
        return {
            "turns": [(turn1, out1), (prompt2, out2)], "holder": holder, "other": other,
            "turn2_on": session.decode_worker,
            "computed": {n: stats[n].num_computed_tokens - computed[n] for n in decodes},
            "prefill_computed": prefill.worker.stats().num_computed_tokens - prefill_computed,
            # the puller's tokens pulled, and computed after a failed pull, during turn 2
            "pulled": stats[other].num_pulled_tokens - before.num_pulled_tokens,
            "failed": stats[other].num_failed_pull_tokens - before.num_failed_pull_tokens,
        }
    finally:
        await router.close()
        await store.close()


def test_a_turn_on_the_other_worker_pulls_the_prefix(tiny_llama_dir, plane, redis_server):
    check_pull(tiny_llama_dir, plane, redis_server, 300)


def test_a_tp2_decode_group_pulls_into_each_ranks_shard(tiny_llama_dir, plane, redis_server):
    # the holder is single-rank (each TP rank would hold a shard); the puller may be a group
    prefill, decodes = plane
    with decode_tp2(worker_spec(tiny_llama_dir, "decode-tp2"), SECRET) as (service, _):
        check_pull(tiny_llama_dir, (prefill, {"decode-0": decodes["decode-0"]}), redis_server,
                   1300, late={"decode-tp2": service})


def test_a_prefix_the_holder_lost_is_computed_by_the_puller(tiny_llama_dir, plane,
                                                          redis_server):
    got, metrics = run_turns(tiny_llama_dir, plane, redis_server, 2300, lose_prefix=True)
    (p1, out1), (p2, out2) = got["turns"]
    assert got["turn2_on"] == got["other"] != got["holder"]
    held = (len(p1) + len(out1) - 1) // BLOCK * BLOCK
    assert (got["pulled"], got["failed"]) == (0, held)
    assert got["computed"][got["other"]] == len(p2) + len(out2) - 1  # the whole prompt
    assert counter(metrics, 'pdserve_kv_pulls_total{result="missed"}') == 1
    assert counter(metrics, 'pdserve_kv_pulls_total{result="pulled"}') == 0
    assert [out1, out2] == reference(tiny_llama_dir, [p1, p2])
    assert_all_free(plane[1].values())


def run_turns(tiny_llama_dir, plane, redis_server, first, **kwargs):
    model = ModelContext.load(str(tiny_llama_dir), "tiny", max_model_len=512)
    metrics = RouterMetrics()
    return asyncio.run(serve(model, plane, redis_server, metrics, first, **kwargs)), metrics


def reference(tiny_llama_dir, prompts) -> list[list[int]]:
    offline = LLM(str(tiny_llama_dir), max_model_len=512, num_kv_blocks=64, num_threads=1)
    return [list(o.token_ids) for o in offline.generate(prompts, GREEDY)]


def assert_all_free(services) -> None:
    for service in services:  # every block back in every pool
        stats = service.worker.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.num_reserved == 0


def check_pull(tiny_llama_dir, plane, redis_server, first, late=None) -> None:
    got, metrics = run_turns(tiny_llama_dir, plane, redis_server, first, late=late)
    (p1, out1), (p2, out2) = got["turns"]
    assert got["turn2_on"] == got["other"] != got["holder"]
    held = (len(p1) + len(out1) - 1) // BLOCK * BLOCK  # the holder ran all but its last token
    assert held == 80 and len(p2) == 112  # numbers neither zero nor equal to the whole prompt
    assert (got["pulled"], got["failed"]) == (held, 0)
    assert got["computed"][got["other"]] == len(p2) - held + len(out2) - 1
    assert got["prefill_computed"] == 0  # the turn never went to the prefill worker
    pulled = 'pdserve_kv_pulls_total{result="pulled"}'
    assert counter(metrics, pulled) == 1
    assert counter(metrics, "pdserve_kv_pull_bytes_total") == held // BLOCK * block_nbytes(
        plane[0])
    assert [out1, out2] == reference(tiny_llama_dir, [p1, p2])
    assert_all_free([*plane[1].values(), *(late or {}).values()])

