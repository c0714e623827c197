"""host:port strings, IPv6 hosts in brackets ([::1]:50051), as gRPC targets and URLs take them."""

from __future__ import annotations


def host_port(host: str, port: int) -> str:
    """`host:port`; an IPv6 host (a colon in it) in brackets unless it has them already."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """(host without brackets, port) of `host:port` or `[v6host]:port`; ValueError if no port."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)
