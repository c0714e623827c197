"""RouterConfig: the router's knobs, set once from the service settings."""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_PLACEMENTS = ("adaptive", "fixed")
# the public gRPC front: the router's own HTTP/2 (router.h2) or grpc.aio's server
GRPC_SERVERS = ("h2", "grpcio")


@dataclass(frozen=True)
class RouterConfig:
    block_size: int = 16
    max_inflight_requests: int = 256
    max_queued_requests: int = 1024
    kv_transfer_timeout_s: float = 30.0
    max_local_prefill_tokens: int = 256
    colocated: bool = False  # no prefill pool: every decode worker prefills its own prompts
    # where a prompt is prefilled when there is a prefill pool: "adaptive" (per request, from
    # measured costs: router.disaggregation) or "fixed" (remote, but for the rule above)
    prefill_placement: str = "adaptive"
    # a decode worker whose output stream says nothing (not even its 1 s keepalive) this long
    # is down, and every request on it ends UNAVAILABLE
    outputs_silence_s: float = 10.0
    worker_rpc_timeout_s: float = 10.0  # Reserve / Start / Submit; late = retried elsewhere
    # times a request is moved to another decode worker when its own dies mid-stream
    migration_limit: int = 1
    # the service's SLO (seconds), and whether a request every prefill worker is predicted to
    # miss its TTFT for is refused at once, RESOURCE_EXHAUSTED / 429 with a retry hint
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    early_rejection: bool = False

    def __post_init__(self) -> None:
        for name in ("kv_transfer_timeout_s", "outputs_silence_s", "worker_rpc_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (seconds), got {getattr(self, name)}")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        for name in ("ttft_slo_s", "tpot_slo_s"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} must be > 0 (seconds), got {value}")
        if self.prefill_placement not in PREFILL_PLACEMENTS:
            raise ValueError(f"prefill_placement must be adaptive or fixed, got "
                             f"{self.prefill_placement!r}")
        if self.early_rejection and self.ttft_slo_s is None:
            raise ValueError("early_rejection needs a TTFT SLO to hold requests to (slo ttft=MS)")
