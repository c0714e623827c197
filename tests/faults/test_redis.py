"""Finding 3: the bundled Redis is never open, never a file writer, never unbounded.

`pdserve up --host 0.0.0.0` used to start it on 0.0.0.0 without a password, where anyone could
`CONFIG SET dir` + `SAVE` (write files as the service's user). Against the real bundled
redis-server, started by the Service's own code path.
"""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve import defaults
from pdserve.launch.redis_server import DISABLED_COMMANDS, RedisServer
from pdserve.launch.service import Service
from pdserve.launch.settings import ServeSettings

_NO_RETRY = {"socket_timeout": 2, "socket_connect_timeout": 2, "retry": Retry(NoBackoff(), 0)}


@pytest.fixture
def bundled():
    """The Redis `pdserve up --host 0.0.0.0` starts (workers on loopback, no password given)."""
    service = Service(ServeSettings(host="0.0.0.0", redis_max_memory_bytes=64 << 20))
    service._start_redis()
    try:
        yield service.redis
    finally:
        service.redis.stop()


def test_public_host_does_not_open_redis(bundled):
    assert bundled.host in defaults.LOOPBACK_HOSTS  # only this process and its workers use it
    anonymous = redis.Redis(host=bundled.host, port=bundled.port, **_NO_RETRY)
    with pytest.raises(redis.AuthenticationError):
        anonymous.set("k", "v")
    anonymous.close()


def test_file_writers_and_admin_commands_are_gone(bundled, tmp_path):
    client = redis.Redis.from_url(bundled.url, **_NO_RETRY)  # even holding the password
    assert client.set("k", "v")
    for command in (("CONFIG", "SET", "dir", str(tmp_path)), ("CONFIG", "GET", "dir"),
                    ("SAVE",), ("BGSAVE",), ("BGREWRITEAOF",), ("DEBUG", "SLEEP", "0"),
                    ("MODULE", "LIST"), ("REPLICAOF", "127.0.0.1", "1"), ("SHUTDOWN",),
                    ("ACL", "LIST")):
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.execute_command(*command)
    assert list(tmp_path.iterdir()) == []  # nothing written where CONFIG SET dir pointed
    assert client.ping() and client.get("k") == b"v"  # still serving
    client.close()


def test_memory_is_capped_with_lru_eviction(bundled):
    client = redis.Redis.from_url(bundled.url, **_NO_RETRY)
    memory = client.info("memory")
    assert memory["maxmemory"] == 64 << 20
    assert memory["maxmemory_policy"] == "allkeys-lru"
    client.close()


def test_no_redis_off_loopback_without_a_password():
    with pytest.raises(ValueError, match="needs a password"):
        RedisServer(host="0.0.0.0")
    assert {"CONFIG", "DEBUG", "MODULE", "SAVE", "BGSAVE"} <= set(DISABLED_COMMANDS)


def test_a_given_password_is_used():
    service = Service(ServeSettings(redis_password="given-pw"))
    service._start_redis()
    try:
        assert service.redis.password == "given-pw"
        client = redis.Redis(host=service.redis.host, port=service.redis.port,
                             password="given-pw", **_NO_RETRY)
        assert client.ping()
        client.close()
    finally:
        service.redis.stop()
