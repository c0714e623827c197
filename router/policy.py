"""Routing policies: pure functions over frozen load snapshots (no I/O, no torch).

The router builds a snapshot per request from what it last heard from each worker plus what
it has itself dispatched since, then asks these functions where to go. Keeping them pure makes
every routing decision reproducible from its inputs and testable without a cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillLoad:
    """What the router knows of one prefill worker's queue."""

    worker_id: str
    num_inflight: int  # requests the router has sent and not yet seen answered
    num_inflight_tokens: int  # their uncached prompt tokens (the work queued there)
    lora_adapters: frozenset[str] = frozenset()  # the LoRA adapters it holds


@dataclass(frozen=True)
class DecodeLoad:
    """What the router knows of one decode worker's KV memory and batch."""

    worker_id: str
    num_blocks: int
    num_free_blocks: int  # last reported, minus blocks the router reserved since
    num_running: int
    max_num_seqs: int
    lora_adapters: frozenset[str] = frozenset()  # the LoRA adapters it holds

    def fits(self, num_blocks_needed: int) -> bool:
        """True when this worker has the KV blocks and a batch slot for one more request."""
        return self.num_free_blocks >= num_blocks_needed and self.num_running < self.max_num_seqs


@dataclass(frozen=True)
class RoutingInfo:
    """The request-side facts routing needs (computed by the router before dispatch)."""

    num_prompt_tokens: int
    num_blocks_needed: int  # blocks the prompt + first tokens need on decode
    session_decode_worker: str | None = None
    # prefill worker id -> prompt tokens already cached there (from the Redis prefix index; a
    # hit in a KV tier below the device priced by what loading it costs: priced_hit_tokens)
    prefix_hits: Mapping[str, int] = field(default_factory=dict, hash=False)
    lora_name: str | None = None  # the LoRA adapter it runs with

    def lacks_adapter(self, held: frozenset[str]) -> bool:
        """Whether a worker holding `held` would first have to read this request's adapter."""
        return self.lora_name is not None and self.lora_name not in held

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0, got {self.num_prompt_tokens}")
        if self.num_blocks_needed < 0:
            raise ValueError(f"num_blocks_needed must be >= 0, got {self.num_blocks_needed}")


def choose_decode(
    workers: Sequence[DecodeLoad], req: RoutingInfo, excluded: Collection[str] = ()
) -> str | None:
    """Session affinity first (if that worker fits), else, among workers that fit (free >=
    needed and running < max_num_seqs), those already holding the request's LoRA adapter
    (adapter affinity), then most free KV blocks; ties broken deterministically (fewest
    running, then worker_id). None when none fits."""
    fitting = [w for w in workers if w.worker_id not in excluded and w.fits(req.num_blocks_needed)]
    if not fitting:
        return None
    if req.session_decode_worker is not None:
        for w in fitting:
            if w.worker_id == req.session_decode_worker:
                return w.worker_id
        logger.debug("session worker %s does not fit; routing by load", req.session_decode_worker)
    best = min(fitting, key=lambda w: (req.lacks_adapter(w.lora_adapters), -w.num_free_blocks,
                                       w.num_running, w.worker_id))
    return best.worker_id


@dataclass(frozen=True)
class TierHits:
    """A prompt's leading blocks one worker holds, each counted in the fastest tier holding
    it: its device pool, or its KV tiers below it (engine.kv_tiers)."""

    device: int = 0
    host: int = 0
    disk: int = 0


TIER_ORDER = ("device", "host", "disk")  # fastest first


def leading_tier_hits(held: Mapping[str, Sequence[bool]]) -> TierHits:
    """`held[tier][i]`: whether block i is in that tier's set (a tier missing: none). The run
    of leading blocks held in any tier (a block held nowhere ends it)."""
    columns = [held.get(tier, ()) for tier in TIER_ORDER]
    counts = dict.fromkeys(TIER_ORDER, 0)
    for i in range(max(map(len, columns))):
        tier = next((t for t, col in zip(TIER_ORDER, columns) if i < len(col) and col[i]), None)
        if tier is None:
            break
        counts[tier] += 1
    return TierHits(**counts)


@dataclass(frozen=True)
class TierCosts:
    """One worker's measured costs (None: not measured yet)."""

    prefill_s_per_token: float | None = None
    host_load_s: float | None = None  # one block, host memory -> device
    disk_load_s: float | None = None  # one block, disk -> host memory (then loaded as above)


UNMEASURED_HIT_SHARE = 0.5  # what a tier hit is worth before its cost was ever measured


def priced_hit_tokens(hits: TierHits, costs: TierCosts, block_size: int) -> int:
    """The prompt tokens a worker's prefix hits save it, tier by tier: a device hit its whole
    prefill, a host hit its prefill less the load, a disk hit its prefill less the read and
    the load (never below nothing), at the worker's measured costs; a tier not measured yet
    (or a worker whose prefill rate is not) counts `UNMEASURED_HIT_SHARE` of a hit."""
    recompute_s = (costs.prefill_s_per_token or 0.0) * block_size

    def share(load_s: float | None) -> float:
        if load_s is None or recompute_s <= 0:
            return UNMEASURED_HIT_SHARE
        return max(0.0, 1.0 - load_s / recompute_s)

    from_disk = (None if costs.disk_load_s is None or costs.host_load_s is None
                 else costs.disk_load_s + costs.host_load_s)
    blocks = hits.device + hits.host * share(costs.host_load_s) + hits.disk * share(from_disk)
    return round(blocks * block_size)


@dataclass(frozen=True)
class PullCosts:
    """Pulling a prefix from the decode worker that holds it, against recomputing it (None:
    not measured yet)."""

    pull_s_per_block: float | None = None  # the router's measured prefix pulls
    prefill_s_per_token: float | None = None  # where it would be recomputed


def pull_tokens(num_prompt_tokens: int, num_held_tokens: int, block_size: int,
                costs: PullCosts) -> int:
    """The prompt's leading tokens to pull from another decode worker that holds its first
    `num_held_tokens`: whole blocks, never the prompt's last token (its logits are computed);
    0 when pulling them would take longer than recomputing them, at the measured costs.
    Until both costs are measured a pull is tried: measuring one is what prices the next."""
    if num_prompt_tokens < 0 or num_held_tokens < 0 or block_size <= 0:
        raise ValueError(f"counts must be >= 0 and block_size > 0, got {num_prompt_tokens}, "
                         f"{num_held_tokens}, {block_size}")
    num_blocks = min(num_held_tokens, num_prompt_tokens - 1) // block_size
    if num_blocks <= 0:
        return 0
    num_tokens = num_blocks * block_size
    if costs.pull_s_per_block is None or costs.prefill_s_per_token is None:
        return num_tokens
    pays = num_blocks * costs.pull_s_per_block < num_tokens * costs.prefill_s_per_token
    return num_tokens if pays else 0


def prefill_work(worker: PrefillLoad, req: RoutingInfo) -> int:
    """Estimated tokens this worker must compute before it finishes `req`: its queued uncached
    tokens plus the part of this prompt it does not already hold in its prefix cache."""
    hit = min(max(req.prefix_hits.get(worker.worker_id, 0), 0), req.num_prompt_tokens)
    return worker.num_inflight_tokens + req.num_prompt_tokens - hit


def choose_prefill(
    workers: Sequence[PrefillLoad], req: RoutingInfo, excluded: Collection[str] = ()
) -> str | None:
    """Least estimated work: queued uncached tokens on that worker + this prompt's tokens not
    cached there (num_prompt_tokens - prefix_hits.get(w, 0), the hits already those of the
    request's adapter); ties: a worker holding the adapter, fewer inflight, then worker_id.
    None when no worker."""
    candidates = [w for w in workers if w.worker_id not in excluded]
    if not candidates:
        return None
    best = min(candidates, key=lambda w: (prefill_work(w, req), req.lacks_adapter(w.lora_adapters),
                                          w.num_inflight, w.worker_id))
    return best.worker_id


def early_rejection(workers: Sequence[PrefillLoad], req: RoutingInfo,
                    prefill_s_per_token: Mapping[str, float | None],
                    ttft_slo_s: float) -> float | None:
    """Early rejection (Mooncake's): when every prefill worker is predicted to give `req` its
    first token later than `ttft_slo_s` — its queued uncached tokens and this prompt's, at its
    measured prefill seconds per token — the seconds a client should wait before retrying (by
    how much the best prediction misses); None to admit. A worker whose rate is not measured
    yet admits: it may be fast. The rate is the step-time fit's slope (no per-step overhead),
    so the prediction errs early, and what it rejects would miss the SLO anyway."""
    predicted = []
    for worker in workers:
        rate = prefill_s_per_token.get(worker.worker_id)
        if not rate or rate < 0:
            return None
        predicted.append(prefill_work(worker, req) * rate)
    if not predicted or min(predicted) <= ttft_slo_s:
        return None
    return min(predicted) - ttft_slo_s


def prefill_locally(
    num_prompt_tokens: int, num_cached_on_decode: int, max_local_prefill_tokens: int
) -> bool:
    """Conditional disaggregation (as NVIDIA Dynamo does): when the session's decode worker
    already holds all but at most `max_local_prefill_tokens` of the prompt, it prefills the
    remainder itself instead of shipping KV from a prefill worker. max_local_prefill_tokens <= 0
    disables it (always remote).

    A short remainder (a chat turn's new message) costs the decode batch less than a remote
    prefill's round trip and KV transfer of the whole prompt would cost the request.
    """
    if num_prompt_tokens < 0 or num_cached_on_decode < 0:
        raise ValueError(
            f"token counts must be >= 0, got num_prompt_tokens={num_prompt_tokens}, "
            f"num_cached_on_decode={num_cached_on_decode}"
        )
    if max_local_prefill_tokens <= 0:
        return False
    num_uncached = max(num_prompt_tokens - num_cached_on_decode, 0)
    return num_uncached <= max_local_prefill_tokens


def shared_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens `a` and `b` have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
