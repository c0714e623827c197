"""RedisServer: a real redis-server subprocess, restartable on its port, password-protected."""

from __future__ import annotations

import os

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.launch.redis_server import RedisServer, redis_server_binary, split_password

_NO_RETRY = {"socket_timeout": 1, "socket_connect_timeout": 1, "retry": Retry(NoBackoff(), 0)}


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, **_NO_RETRY)


def test_binary_is_found_and_executable():
    path = redis_server_binary()
    assert os.path.basename(path) == "redis-server" and os.access(path, os.X_OK)


def test_start_stop_restart_on_the_same_port():
    server = RedisServer(port=0)
    assert server.port == 0 and not server.running
    with server:
        port = server.port
        assert port > 0 and server.url == f"redis://127.0.0.1:{port}/0"
        client = _client(server.url)
        assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
        server.stop()
        server.stop()  # idempotent
        assert not server.running
        with pytest.raises(redis.ConnectionError):
            client.ping()
        server.start()
        assert server.running and server.port == port
        assert client.ping() and client.get("k") is None  # nothing persisted by default
        pid = client.info("server")["process_id"]
        assert pid == server._proc.pid
        client.close()
    assert not server.running and server.log_path is None  # temp dir removed


def test_a_launcher_runs_the_server_under_it():
    """`launcher` prefixes the command (tests/hosts runs it under `ip netns exec`): `env` execs
    the server, so the process started, waited for and stopped is redis-server itself."""
    with RedisServer(port=0, launcher=("env", "PDSERVE_UNDER_LAUNCHER=1")) as server:
        client = _client(server.url)
        info = client.info("server")
        assert client.ping() and info["process_id"] == server._proc.pid
        assert info["executable"].endswith("redis-server")
    with pytest.raises(redis.ConnectionError):
        client.ping()


def test_password_required():
    with RedisServer(port=0, password='s3cr"t @/x') as server:
        assert server.url.startswith("redis://:s3cr%22t%20%40%2Fx@127.0.0.1:")
        anonymous = redis.Redis(host=server.host, port=server.port, **_NO_RETRY)
        with pytest.raises(redis.AuthenticationError):
            anonymous.set("k", "v")
        wrong = redis.Redis(host=server.host, port=server.port, password="nope", **_NO_RETRY)
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
        client = _client(server.url)
        assert client.set("k", "v") and client.get("k") == b"v"
        for c in (anonymous, wrong, client):
            c.close()


def test_taken_port_fails_clearly_and_leaves_the_other_server_alone(redis_server):
    other = RedisServer(port=redis_server.port, startup_timeout_s=5)
    with pytest.raises(RuntimeError, match="log tail") as info:
        other.start()
    assert str(redis_server.port) in str(info.value)
    assert not other.running and other.log_path is None  # its temp dir is gone too
    other.stop()
    client = _client(redis_server.url)
    assert client.ping() and client.info("server")["process_id"] == redis_server._proc.pid
    client.close()


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="port"):
        RedisServer(port=70000)
    with pytest.raises(ValueError, match="password"):
        RedisServer(password="a\nb")


@pytest.mark.parametrize("url, given, expected", [
    ("redis://:p%40ss@127.0.0.1:6379/0", None, ("redis://127.0.0.1:6379/0", "p@ss")),
    ("redis://user:pw@[::1]:6379/2", "other", ("redis://user@[::1]:6379/2", "pw")),
    ("redis://10.0.0.5:6379/0", "given", ("redis://10.0.0.5:6379/0", "given")),
    ("redis://10.0.0.5:6379/0", None, ("redis://10.0.0.5:6379/0", None)),
])
def test_a_worker_gets_the_url_without_its_password(url, given, expected):
    assert split_password(url, given) == expected
