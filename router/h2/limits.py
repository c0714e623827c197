"""Limits: what one client may make the router's gRPC front hold or do (router/h2)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_streams: int = 1024
    max_message: int = 4 * 1024 * 1024  # what grpc's servers accept by default
    max_header_block: int = 64 * 1024
    max_header_list: int = 16 * 1024
    recv_window: int = 1024 * 1024  # per stream, and added to the connection's
    resets_per_s: float = 100.0
    reset_burst: int = 1000
    preface_timeout_s: float = 10.0
    write_buffer_high: int = 1024 * 1024


DEFAULT_LIMITS = Limits()
