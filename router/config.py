"""RouterConfig: the router's knobs, set once from the service settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    block_size: int = 16
    max_inflight_requests: int = 256
    max_queued_requests: int = 1024
    kv_transfer_timeout_s: float = 30.0
    max_local_prefill_tokens: int = 256
    colocated: bool = False  # no prefill pool: every decode worker prefills its own prompts
