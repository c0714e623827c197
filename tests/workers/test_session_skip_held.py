"""Issue 18, "skip what decode holds": turn 2 of a session on the decode worker that ran turn 1
gets only the KV blocks that worker lacks.

Real services in this process: one prefill and two decode workers behind their authenticated
gRPC servers with gloo KV channels on 127.0.0.1, a real redis-server holding the session, and
the real Router with remote prefill forced (fixed placement, `max_local_prefill_tokens=0`:
turn 2 goes Reserve -> Prefill -> push even though the decode worker caches most of it).
Counted from the router's metrics against the layout's bytes per block: turn 1 pushes every
block of its prompt; turn 2 pushes only the blocks after those the decode worker cached while
running turn 1 (its prompt and all its output but the last token), and the skipped bytes are
exactly those cached blocks. The decode worker's Reserve reply names them. Greedy output of
both turns equals the offline engine's. Again with a TP-2 decode group (rank 1 in its own
process), whose ranks each hold their KV-head shard of the cached blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import grpc
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
    start_decode,
    start_prefill,
    worker_spec,
)
from tests.workers.pd import SECRET  # what a TP follower process (tests.workers.host) holds

AUTH = SECRET.grpc_metadata()

CALL_S = 60.0
BLOCK = 16  # WorkerSpec's default block size
TURN1 = list(range(300, 340))  # 40 tokens: 3 blocks
NEW = list(range(500, 530))  # turn 2's new message: 30 tokens
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@contextlib.contextmanager
def two_decode_plane(model_dir, **decode_limits):
    """(the prefill service, {name: decode service}) of one prefill and two decode workers;
    `decode_limits` override the decode workers' WorkerSpec fields."""
    prefill = start_prefill(worker_spec(model_dir, "prefill-0"), SECRET)
    decodes = {}
    try:
        for name in ("decode-0", "decode-1"):
            spec = dataclasses.replace(worker_spec(model_dir, name), **decode_limits)
            decodes[name] = start_decode(spec, SECRET)
        yield prefill, decodes
    finally:
        for service in decodes.values():
            service.stop()
        prefill.stop()


@pytest.fixture(scope="module")
def plane(tiny_llama_dir):
    with two_decode_plane(tiny_llama_dir) as workers:
        yield workers


def block_nbytes(prefill) -> int:
    """K and V of one block over every layer and KV head, from the layout's definition."""
    layout = prefill.worker.layout
    assert layout.dtype == "float32" and layout.block_size == BLOCK
    return 2 * BLOCK * layout.num_kv_heads * layout.head_dim * 4 * layout.num_layers


def counter(metrics: RouterMetrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the exposition")


async def serve_two_turns(model, plane, redis_server, metrics: RouterMetrics):
    prefill, decodes = plane
    store = RedisStore(redis_server.url, namespace="skip", timeout_s=2.0)
    router = Router(model, RouterConfig(max_local_prefill_tokens=0, prefill_placement="fixed"),
                    metrics, store, secret=SECRET)
    session_id = scoped_session_id(tenant_of("alpha"), "chat-" + "-".join(decodes))
    try:
        await router.add_worker("prefill-0", "prefill", prefill.address)
        for name, service in decodes.items():
            await router.add_worker(name, "decode", service.address)
        await router.wait_ready(CALL_S)
        turns, workers, prompt = [], [], TURN1
        for i in range(2):
            req = ValidRequest(f"turn-{i + 1}", tuple(prompt), GREEDY, session_id)
            out = [t for m in await asyncio.wait_for(_collect(router, req), CALL_S)
                   for t in m.token_ids]
            turns.append((prompt, out))
            session = await _session(store, session_id, prompt + out)
            workers.append(session.decode_worker)
            prompt = prompt + out + NEW
        return turns, workers
    finally:
        await router.close()
        await store.close()


async def _collect(router: Router, req: ValidRequest) -> list:
    return [m async for m in router.generate(req, time.monotonic())]


async def _session(store: RedisStore, session_id: str, history: list[int]):
    """The session once the router's background write of `history` landed (bounded)."""
    end = time.monotonic() + 10.0
    while (s := await store.get_session(session_id)) is None or list(s.token_ids) != history:
        assert time.monotonic() < end, "the session was never written"
        await asyncio.sleep(0.05)
    return s


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=512, num_kv_blocks=64, num_threads=1)


def test_turn_two_pushes_only_the_blocks_decode_lacks(tiny_llama_dir, plane, redis_server,
                                                       offline):
    check_two_turns(tiny_llama_dir, plane, redis_server, offline)


def test_a_tp2_decode_group_skips_the_same_blocks(tiny_llama_dir, plane, redis_server, offline):
    with decode_tp2(worker_spec(tiny_llama_dir, "decode-tp2"), SECRET) as (service, _):
        check_two_turns(tiny_llama_dir, (plane[0], {"decode-tp2": service}), redis_server,
                        offline)


def check_two_turns(tiny_llama_dir, plane, redis_server, offline) -> None:
    model = ModelContext.load(str(tiny_llama_dir), "tiny", max_model_len=512)
    metrics = RouterMetrics()
    turns, workers = asyncio.run(serve_two_turns(model, plane, redis_server, metrics))
    (p1, out1), (p2, out2) = turns
    assert workers[0] == workers[1]  # session affinity: turn 2 ran where turn 1 did
    assert len(out1) == len(out2) == MAX_TOKENS
    per_block = block_nbytes(plane[0])
    # the decode worker computed turn 1's prompt and output but its last token
    held = (len(p1) + len(out1) - 1) // BLOCK
    total1, total2 = -(-len(p1) // BLOCK), -(-len(p2) // BLOCK)
    pushed, skipped = (counter(metrics, "pdserve_kv_transfer_bytes_total") / per_block,
                       counter(metrics, "pdserve_kv_transfer_skipped_bytes_total") / per_block)
    print(f"turn 1: {total1} blocks pushed; turn 2: {total2} blocks, {held} held by decode, "
          f"{total2 - held} pushed; counters: pushed {pushed} blocks, skipped {skipped}")
    assert held == 3 and total2 == 6  # the numbers below are not all zero or all equal
    assert skipped == held
    assert pushed == total1 + (total2 - held)
    want = [o.token_ids for o in offline.generate([p1, p2], GREEDY)]
    assert [out1, out2] == [list(t) for t in want]
    # the Reserve reply names what the decode worker holds: turn 2's whole history now
    history = p2 + out2
    assert reserve_cached_blocks(plane, workers[1], history) == (len(history) - 1) // BLOCK


def reserve_cached_blocks(plane, worker: str, prompt: list[int]) -> int:
    """Reserve `prompt` on `worker` over gRPC, then abort it: its num_cached_blocks."""
    prefill, decodes = plane
    channel, stub = decode_stub(decodes[worker].address)
    try:
        reply = stub.Reserve(worker_pb2.ReserveRequest(
            request_id="probe", prompt_token_ids=prompt, sampling=sampling(),
            sources=[source_of(prefill)], deadline=time.time() + 30, router_id="probe"),
            metadata=AUTH, timeout=CALL_S)
        assert reply.granted
        return reply.num_cached_blocks
    finally:
        with contextlib.suppress(grpc.RpcError):
            stub.Abort(worker_pb2.WorkerAbortRequest(request_id="probe"), metadata=AUTH,
                       timeout=CALL_S)
        channel.close()
