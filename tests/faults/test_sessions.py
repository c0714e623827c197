"""Finding 5: sessions in Redis are owned by an API token, bounded in size and in count.

Before: one key per client-given session id (`{ns}:session:{id}`), so any client could read and
overwrite another's session by sending its id; a session kept every token of its history and a
client could create sessions without end. Against a real redis-server (password-protected, as
`pdserve up` starts it), through the real gRPC front where the router writes the sessions.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from pdserve.client import AsyncClient
from pdserve.engine.sampling_params import SamplingParams
from pdserve.launch.redis_server import RedisServer
from pdserve.redis_keys import scoped_session_id, session_key, sessions_index_key
from pdserve.router.auth import tenant_of
from pdserve.router.store import RedisStore, Session
from pdserve.router.validation import ModelContext
from tests.faults.fronts_harness import fronts
from tests.faults.router_fakes import TOKENS

CALL_S = 20.0
STORE_TIMEOUT_S = 0.5  # generous: a loaded 2-core machine
GREEDY = SamplingParams(max_tokens=len(TOKENS), temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_llama_dir) -> ModelContext:
    return ModelContext.load(str(tiny_llama_dir), "tiny", max_model_len=512)


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer(port=0, password="sessions-test-pw") as server:
        yield server


async def _session(store: RedisStore, session_id: str, timeout: float = 5.0) -> Session:
    """The session once the router's background write landed (bounded wait)."""
    end = time.monotonic() + timeout
    while (session := await store.get_session(session_id)) is None:
        assert time.monotonic() < end, f"session {session_id!r} never written"
        await asyncio.sleep(0.05)
    return session


def test_each_token_owns_its_session_ids(model, redis_server):
    alpha, beta = tenant_of("alpha"), tenant_of("beta")

    async def main():
        store = RedisStore(redis_server.url, namespace="own", timeout_s=STORE_TIMEOUT_S)
        async with (fronts(model, api_tokens=("alpha", "beta"), store=store) as f,
                    AsyncClient(f.address, timeout=CALL_S, api_token="alpha") as a,
                    AsyncClient(f.address, timeout=CALL_S, api_token="beta") as b):
            await a.complete([1, 2, 3], session_id="shared", sampling=GREEDY)
            mine = await _session(store, scoped_session_id(alpha, "shared"))
            await b.complete([4, 5, 6, 7], session_id="shared", sampling=GREEDY)
            # a crafted id naming alpha's namespace stays inside beta's
            await b.complete([8, 9], session_id=f"{alpha}/shared", sampling=GREEDY)
            theirs = await _session(store, scoped_session_id(beta, "shared"))
            await _session(store, scoped_session_id(beta, f"{alpha}/shared"))
            after = await store.get_session(scoped_session_id(alpha, "shared"))
        await store.close()
        return mine, theirs, after

    mine, theirs, after = asyncio.run(main())
    assert mine == after == Session((1, 2, 3, *TOKENS), "decode-0")  # untouched by beta
    assert theirs == Session((4, 5, 6, 7, *TOKENS), "decode-0")
    client = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    assert client.exists(session_key("own", "shared")) == 0  # no unscoped key, ever
    client.close()


def test_history_is_capped_to_its_leading_tokens(model, redis_server):
    async def main():
        store = RedisStore(redis_server.url, namespace="size", timeout_s=STORE_TIMEOUT_S,
                           session_max_tokens=8)
        async with fronts(model, store=store) as f, \
                AsyncClient(f.address, timeout=CALL_S) as client:
            await client.complete(list(range(1, 21)), session_id="long", sampling=GREEDY)
            session = await _session(store, scoped_session_id("public", "long"))
        await store.close()
        return session

    assert asyncio.run(main()) == Session(tuple(range(1, 9)), "decode-0")


def test_sessions_per_token_are_capped_least_recently_used_first(redis_server):
    async def main():
        store = RedisStore(redis_server.url, namespace="count", timeout_s=STORE_TIMEOUT_S,
                           session_ttl_s=600, max_sessions_per_tenant=3)
        for i in range(5):
            await store.put_session(scoped_session_id("t1", f"s{i}"), [i], "d")
            await asyncio.sleep(0.002)  # distinct last-use times
        await store.put_session(scoped_session_id("t2", "other"), [9], "d")
        await store.put_session(scoped_session_id("t1", "s2"), [2, 2], "d")  # s2 used again
        await store.put_session(scoped_session_id("t1", "s5"), [5], "d")
        kept = {i: await store.get_session(scoped_session_id("t1", f"s{i}")) for i in range(6)}
        other = await store.get_session(scoped_session_id("t2", "other"))
        healthy = store.healthy
        await store.close()
        return kept, other, healthy

    kept, other, healthy = asyncio.run(main())
    assert healthy
    assert {i for i, s in kept.items() if s is not None} == {2, 4, 5}
    assert kept[2] == Session((2, 2), "d")
    assert other == Session((9,), "d")  # another token's sessions are not its to evict
    client = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    index = sessions_index_key("count", "t1")
    assert client.zcard(index) == 3
    assert 0 < client.ttl(index) <= 600
    for i in (0, 1, 3):  # evicted sessions' keys are gone with their index entries
        assert client.exists(session_key("count", scoped_session_id("t1", f"s{i}"))) == 0
    client.close()
