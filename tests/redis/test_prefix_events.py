"""PrefixIndexPublisher against a real redis-server: events, snapshots, recovery."""

from __future__ import annotations

import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.engine.block_hash import hash_block
from pdserve.engine.block_pool import Block, BlockPool
from pdserve.launch.redis_server import RedisServer
from pdserve.prefill_worker.prefix_events import PrefixIndexPublisher
from tests.redis.conftest import wait_until


def _h(i: int) -> bytes:
    return hash_block(None, [i])


class Owner:
    """Stands in for the prefill worker's loop thread: owns the pool, drives the publisher."""

    def __init__(self, publisher: PrefixIndexPublisher, num_blocks: int = 8) -> None:
        self.pool = BlockPool(num_blocks, record_events=True)
        self.publisher = publisher
        self.held: list[Block] = []

    def store(self, i: int) -> None:
        """Cache a block for token i, releasing (but keeping cached) the oldest when full."""
        if self.pool.num_free_blocks == 0:
            self.pool.release([self.held.pop(0)])
        (block,) = self.pool.allocate(1)
        self.pool.cache(block, _h(i), [i])
        self.held.append(block)
        if len(self.held) > 2:
            self.pool.release([self.held.pop(0)])  # free but cached: evicted on reuse

    def step(self) -> None:
        self.publisher.publish(*self.pool.drain_events())
        if self.publisher.needs_snapshot:
            self.publisher.snapshot(self.pool.cached_hashes())


def _members(url: str, key: str) -> set[bytes] | None:
    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1,
                                  retry=Retry(NoBackoff(), 0))
    try:
        return client.smembers(key)
    except redis.ConnectionError:
        return None
    finally:
        client.close()


def _in_sync(owner: Owner, url: str) -> bool:
    owner.step()
    return owner.publisher.synced and _members(url, owner.publisher.key) == set(
        owner.pool.cached_hashes())


def test_events_are_applied_after_the_first_snapshot(redis_server):
    pub = PrefixIndexPublisher(redis_server.url, None, "t-ev", "w0", check_interval_s=0.2)
    owner = Owner(pub)
    try:
        owner.store(0)  # cached before the first snapshot: reaches Redis through it
        wait_until(lambda: _in_sync(owner, redis_server.url), what="first snapshot")
        assert pub.num_snapshots == 1 and pub.healthy
        for i in range(1, 20):  # 8 blocks, so the early hashes get evicted
            owner.store(i)
            owner.step()
        assert owner.pool.num_evictions > 5
        expected = set(owner.pool.cached_hashes())
        assert _h(0) not in expected and _h(19) in expected
        wait_until(lambda: _members(redis_server.url, pub.key) == expected, what="events")
        assert pub.num_snapshots == 1  # events alone kept it in sync
    finally:
        pub.close()
    assert _members(redis_server.url, pub.key) == expected  # close deletes nothing


def test_snapshot_replaces_stale_members(redis_server):
    key = "t-stale:prefix:w0"
    client = redis.Redis.from_url(redis_server.url)
    client.sadd(key, _h(100), _h(101))  # left by an earlier incarnation of the worker
    client.close()
    pub = PrefixIndexPublisher(redis_server.url, None, "t-stale", "w0")
    owner = Owner(pub)
    try:
        owner.store(1)
        owner.store(2)
        wait_until(lambda: _in_sync(owner, redis_server.url), what="snapshot")
        assert _members(redis_server.url, key) == {_h(1), _h(2)}
    finally:
        pub.close()


def test_resnapshots_after_redis_restart(own_redis_server):
    server = own_redis_server
    pub = PrefixIndexPublisher(server.url, None, "t-rs", "w0", timeout_s=0.2,
                               check_interval_s=0.2)
    owner = Owner(pub)
    try:
        for i in range(5):
            owner.store(i)
        wait_until(lambda: _in_sync(owner, server.url), what="first sync")
        server.stop()
        start = time.monotonic()
        for i in range(5, 15):  # the worker keeps serving while Redis is down
            owner.store(i)
            owner.step()
        assert time.monotonic() - start < 0.5  # publish never waits on Redis
        wait_until(lambda: not pub.healthy, what="publisher noticing the outage")
        server.start()  # same port, empty
        assert _members(server.url, pub.key) == set()
        wait_until(lambda: _in_sync(owner, server.url), what="re-snapshot after restart")
        assert pub.healthy and pub.num_snapshots >= 2
        assert len(_members(server.url, pub.key)) == owner.pool.num_cached_blocks > 0
    finally:
        pub.close()


def test_resnapshots_after_a_quick_restart_without_traffic(own_redis_server):
    """A restart between two calls is caught by the server's run_id changing."""
    server = own_redis_server
    pub = PrefixIndexPublisher(server.url, None, "t-quick", "w0", check_interval_s=0.2)
    owner = Owner(pub)
    try:
        for i in range(3):
            owner.store(i)
        wait_until(lambda: _in_sync(owner, server.url), what="first sync")
        server.stop()
        server.start()
        assert _members(server.url, pub.key) == set()
        wait_until(lambda: _in_sync(owner, server.url), what="re-snapshot")
        assert len(_members(server.url, pub.key)) == 3
    finally:
        pub.close()


def test_starts_while_redis_is_down_and_closes_promptly():
    server = RedisServer(port=0).start()
    server.stop()  # its port is known, nothing listens there yet
    pub = PrefixIndexPublisher(server.url, None, "t-down", "w0", timeout_s=0.2)
    owner = Owner(pub)
    try:
        owner.store(1)
        owner.step()
        wait_until(lambda: pub._healthy is False, what="first failure")
        assert not pub.synced and not pub.healthy
        server.start()
        wait_until(lambda: _in_sync(owner, server.url), what="sync once redis is up")
        server.stop()
        wait_until(lambda: (owner.step(), not pub.healthy)[1], what="outage noticed")
        start = time.monotonic()
        pub.close()  # while Redis is down: bounded, no exception
        assert time.monotonic() - start < 3.0 and not pub._thread.is_alive()
        pub.publish([_h(9)], [])  # after close: a no-op, not an error
    finally:
        pub.close()
        server.stop()


def test_each_tier_has_its_own_set_and_a_snapshot_empties_a_tier_it_does_not_name(redis_server):
    url = redis_server.url
    client = redis.Redis.from_url(url)
    client.sadd("t-tier:prefix:w0:disk", _h(50))  # an earlier run's disk tier
    client.close()
    pub = PrefixIndexPublisher(url, None, "t-tier", "w0", check_interval_s=0.2)
    try:
        wait_until(lambda: pub.needs_snapshot, what="the publisher asks for a snapshot")
        pub.snapshot([_h(1)], {"host": [_h(1), _h(2)]})
        wait_until(lambda: pub.synced, what="snapshot applied")
        pub.publish([_h(3)], [_h(2)], "host")
        pub.publish([_h(2)], [], "disk")
        keys = pub.keys
        wait_until(lambda: _members(url, keys["disk"]) == {_h(2)}, what="tier events")
        assert _members(url, keys["device"]) == {_h(1)}
        assert _members(url, keys["host"]) == {_h(1), _h(3)}
        assert keys == {"device": "t-tier:prefix:w0", "host": "t-tier:prefix:w0:host",
                        "disk": "t-tier:prefix:w0:disk"}
    finally:
        pub.close()
