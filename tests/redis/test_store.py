"""RedisStore against a real redis-server: sessions, prefix hits, namespaces, fail-open."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.engine.block_hash import hash_blocks
from pdserve.router.policy import TierHits
from pdserve.router.store import RedisStore, Session

TIMEOUT_S = 0.25  # generous for a loaded 2-core machine; the fail-open tests use the default


def _sync(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=1, retry=Retry(NoBackoff(), 0))


def _hashes(n: int) -> list[bytes]:
    return hash_blocks(list(range(16 * n)), 16)


def test_session_round_trip_and_ttl(redis_server):
    async def main() -> None:
        store = RedisStore(redis_server.url, namespace="t-sess", timeout_s=TIMEOUT_S,
                           session_ttl_s=600)
        assert await store.get_session("s1") is None
        await store.put_session("s1", [1, 2, 3], "decode-0")
        assert await store.get_session("s1") == Session((1, 2, 3), "decode-0")
        client = _sync(redis_server.url)
        assert client.hgetall("t-sess:session:s1") == {
            b"token_ids": b"[1, 2, 3]", b"decode_worker": b"decode-0"}
        assert 590 <= client.ttl("t-sess:session:s1") <= 600
        client.expire("t-sess:session:s1", 5)
        await store.put_session("s1", [1, 2, 3, 4, 5], "decode-1")  # overwrite, TTL reset
        assert await store.get_session("s1") == Session((1, 2, 3, 4, 5), "decode-1")
        assert client.ttl("t-sess:session:s1") > 5
        client.hset("t-sess:session:bad", mapping={"token_ids": "oops", "decode_worker": "d"})
        assert await store.get_session("bad") is None  # malformed: unknown, not an error
        assert store.healthy
        client.close()
        await store.close()

    asyncio.run(main())


def test_prefix_hits_count_leading_hashes_per_worker(redis_server):
    h = _hashes(4)
    client = _sync(redis_server.url)
    client.sadd("t-pfx:prefix:w-all", *h[:3])
    client.sadd("t-pfx:prefix:w-hole", h[0], h[2], h[3])  # h1 missing: count stops at 1
    client.sadd("t-pfx:prefix:w-tail", h[1], h[2])  # no first block: no prefix at all
    client.close()

    async def main() -> None:
        store = RedisStore(redis_server.url, namespace="t-pfx", timeout_s=TIMEOUT_S)
        hits = await store.prefix_hits(h, ["w-all", "w-hole", "w-tail", "w-none"])
        assert hits == {"w-all": TierHits(3), "w-hole": TierHits(1), "w-tail": TierHits(0),
                        "w-none": TierHits(0)}
        assert await store.prefix_hits(h[:2], ["w-all", "w-hole"]) == {
            "w-all": TierHits(2), "w-hole": TierHits(1)}
        # order matters
        assert await store.prefix_hits(h[1:], ["w-tail"]) == {"w-tail": TierHits(2)}
        await store.close()

    asyncio.run(main())


def test_prefix_hits_follow_a_prefix_into_each_workers_kv_tiers(redis_server):
    h = _hashes(5)
    client = _sync(redis_server.url)
    client.sadd("t-tier:prefix:w", h[0])
    client.sadd("t-tier:prefix:w:host", h[0], h[1], h[2])  # written through: h0 is in both
    client.sadd("t-tier:prefix:w:disk", h[3])  # h4 nowhere: the run ends there
    client.sadd("t-tier:prefix:v:disk", *h)
    client.close()

    async def main() -> None:
        store = RedisStore(redis_server.url, namespace="t-tier", timeout_s=TIMEOUT_S)
        assert await store.prefix_hits(h, ["w", "v"]) == {
            "w": TierHits(device=1, host=2, disk=1), "v": TierHits(disk=5)}
        await store.close()

    asyncio.run(main())


def test_empty_inputs_do_not_touch_redis():
    async def main() -> None:
        with socket.socket() as sock:  # a port nobody listens on
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        store = RedisStore(f"redis://127.0.0.1:{port}/0")
        assert await store.prefix_hits([], ["w"]) == {}
        assert await store.prefix_hits(_hashes(1), []) == {}
        assert store.healthy  # no call was made, so no failure either
        assert await store.prefix_hits(_hashes(1), ["w"]) == {}
        assert not store.healthy
        await store.close()

    asyncio.run(main())


def test_namespaces_are_isolated(redis_server):
    h = _hashes(2)

    async def main() -> None:
        a = RedisStore(redis_server.url, namespace="ns-a", timeout_s=TIMEOUT_S)
        b = RedisStore(redis_server.url, namespace="ns-b", timeout_s=TIMEOUT_S)
        await a.put_session("s", [7], "d-a")
        assert await b.get_session("s") is None
        await b.put_session("s", [8], "d-b")
        assert await a.get_session("s") == Session((7,), "d-a")
        client = _sync(redis_server.url)
        client.sadd(a.prefix_key("w"), *h)
        client.close()
        assert await a.prefix_hits(h, ["w"]) == {"w": TierHits(2)}
        assert await b.prefix_hits(h, ["w"]) == {"w": TierHits(0)}
        await a.close()
        await b.close()

    asyncio.run(main())


def test_password_protected_server():
    from pdserve.launch.redis_server import RedisServer

    with RedisServer(port=0, password="pw") as server:
        bare_url = f"redis://127.0.0.1:{server.port}/0"

        async def main() -> None:
            anonymous = RedisStore(bare_url, timeout_s=TIMEOUT_S)
            assert await anonymous.get_session("s") is None and not anonymous.healthy
            store = RedisStore(bare_url, password="pw", timeout_s=TIMEOUT_S)
            await store.put_session("s", [1], "d")
            assert await store.get_session("s") == Session((1,), "d") and store.healthy
            await anonymous.close()
            await store.close()

        asyncio.run(main())


async def _timed(coro):
    start = time.monotonic()
    result = await coro
    return result, time.monotonic() - start


def test_fails_open_when_stopped_and_recovers_on_restart(own_redis_server, caplog):
    server, h = own_redis_server, _hashes(2)

    async def main() -> None:
        store = RedisStore(server.url, timeout_s=TIMEOUT_S)
        await store.put_session("s", [1, 2], "d")
        _sync(server.url).sadd(store.prefix_key("w"), *h)
        assert await store.prefix_hits(h, ["w"]) == {"w": TierHits(2)} and store.healthy
        server.stop()
        with caplog.at_level(logging.INFO, logger="pdserve.router.store"):
            for _ in range(3):  # one warning for the transition, not one per call
                session, elapsed = await _timed(store.get_session("s"))
                assert session is None and elapsed < 0.5
                hits, elapsed = await _timed(store.prefix_hits(h, ["w"]))
                assert hits == {} and elapsed < 0.5
                _, elapsed = await _timed(store.put_session("s", [3], "d"))
                assert elapsed < 0.5
                ok, elapsed = await _timed(store.check())
                assert ok is False and elapsed < 0.5
            assert not store.healthy
            server.start()  # same port, empty
            assert await store.check() is True and store.healthy
        records = [r for r in caplog.records if r.name == "pdserve.router.store"]
        assert [r.levelno for r in records] == [logging.WARNING, logging.INFO]
        assert await store.get_session("s") is None  # the restarted server is empty
        await store.put_session("s", [4, 5], "d2")
        assert await store.get_session("s") == Session((4, 5), "d2")
        assert await store.prefix_hits(h, ["w"]) == {"w": TierHits(0)}
        await store.close()

    asyncio.run(main())


def test_unresponsive_server_is_bounded_by_the_timeout():
    """A server that accepts connections but never answers must not hold the caller."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # connects complete in the backlog; nothing ever replies
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"

        async def main() -> None:
            store = RedisStore(url, timeout_s=0.1)
            for call in (store.get_session("s"), store.prefix_hits(_hashes(1), ["w"]),
                         store.put_session("s", [1], "d"), store.check()):
                result, elapsed = await _timed(call)
                assert result in (None, {}, False) and 0.05 < elapsed < 0.5
            assert not store.healthy
            await store.close()

        asyncio.run(main())


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="timeout_s"):
        RedisStore("redis://127.0.0.1:1/0", timeout_s=0)
    with pytest.raises(ValueError, match="session_ttl_s"):
        RedisStore("redis://127.0.0.1:1/0", session_ttl_s=0)
    with pytest.raises(ValueError, match="namespace"):
        RedisStore("redis://127.0.0.1:1/0", namespace="")
