"""host:port strings with IPv6 hosts, and a worker gRPC server and the HTTP front on ::1."""

from __future__ import annotations

import socket

import grpc
import pytest

from pdserve.address import host_port, split_host_port
from pdserve.worker_grpc import bind


@pytest.mark.parametrize(("host", "port", "address"), [
    ("127.0.0.1", 50051, "127.0.0.1:50051"), ("::1", 7, "[::1]:7"),
    ("fd00::2", 6379, "[fd00::2]:6379"), ("[::1]", 9, "[::1]:9"), ("node-3", 1, "node-3:1"),
])
def test_host_port_round_trips(host, port, address):
    assert host_port(host, port) == address
    assert split_host_port(address) == (host.strip("[]"), port)


@pytest.mark.parametrize("bad", ["auto", "host", "host:", "[::1]", "::1:x"])
def test_split_refuses_what_has_no_port(bad):
    with pytest.raises(ValueError, match="host:port"):
        split_host_port(bad)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this host")
def test_a_worker_server_on_ipv6_is_dialed_by_its_address():
    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(ThreadPoolExecutor(1))
    port = bind(server, "::1", None)
    server.start()
    try:
        with grpc.insecure_channel(host_port("::1", port)) as channel:
            grpc.channel_ready_future(channel).result(timeout=10)
    finally:
        server.stop(None)
