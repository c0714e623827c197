"""WorkerStats: a worker's load, as its gRPC service reports it (proto/worker.proto WorkerLoad).

One message for both roles: a prefill worker reserves nothing (nor speculates) and a decode
worker's `num_computed_tokens` counts its local prefills. The speculative decoding counts are
cumulative since the worker started (acceptance rate = accepted / draft tokens; mean accepted
length = (accepted + verifications) / verifications, the tokens one verification emits).
With KV tiers under the device pool (engine/kv_tiers.py), it also reports the blocks each tier
holds now and the tiers' cumulative counts in blocks (engine.kv_tiers.TierStats); all 0 without
tiers. Read on the engine's loop thread, or as a racy-but-harmless snapshot from another one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

# WorkerStats' KV tier fields, named as WorkerLoad's (proto/worker.proto)
KV_TIER_FIELDS: tuple[str, ...] = (
    "kv_block_bytes", "num_kv_host_blocks", "num_kv_disk_blocks", "num_kv_host_hits",
    "num_kv_disk_hits", "num_kv_stores", "num_kv_demotions", "num_kv_promotions",
    "num_kv_failed_promotions", "num_kv_tier_evictions", "kv_tier_saved_s",
    "kv_host_load_s", "kv_disk_load_s",
)
# ... and its steps' (the router prices where a prompt is prefilled with them)
STEP_FIELDS: tuple[str, ...] = (
    "step_token_budget", "prefill_s_per_token", "step_intercept_s", "step_slope_fitted",
    "decode_s_per_token", "num_prefill_tokens",
)


@dataclass(frozen=True)
class WorkerStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int  # blocks the prefix cache can hit (in use or free)
    num_running: int
    num_waiting: int
    num_reserved: int  # blocks held while their prompt KV arrives from a prefill worker
    num_computed_tokens: int  # tokens run through the model, all steps
    max_num_seqs: int
    block_size: int
    tp_size: int
    num_spec_verifications: int  # one sequence's drafts checked in one step
    num_draft_tokens: int  # drafts verified
    num_accepted_tokens: int  # drafts accepted
    quantization: str = ""  # the weights' ("" = dense)
    weight_bytes: int = 0  # this rank's weights as held
    lora_adapters: tuple[str, ...] = ()  # the LoRA adapters it holds
    # Its steps: what the next may compute (Scheduler.step_token_budget); the step-time fit (a
    # step of p prompt and d decode tokens lasts step_intercept_s + prefill_s_per_token * p +
    # decode_s_per_token * d; the prompt slope is a marginal rate only with step_slope_fitted,
    # the decode one only when not 0); and the prompt tokens queued here not computed yet
    # (waiting, or part-way through their prefill)
    step_token_budget: int = 0
    prefill_s_per_token: float = 0.0
    step_intercept_s: float = 0.0
    step_slope_fitted: bool = False
    decode_s_per_token: float = 0.0
    num_prefill_tokens: int = 0
    # KV tiers (engine.kv_tiers), 0 without them: one block's bytes, blocks held now, then
    # cumulative counts in blocks (TierStats)
    kv_block_bytes: int = 0
    num_kv_host_blocks: int = 0
    num_kv_disk_blocks: int = 0
    num_kv_host_hits: int = 0  # loaded from host instead of recomputed
    num_kv_disk_hits: int = 0  # promoted from disk, then loaded
    num_kv_stores: int = 0  # written through to host
    num_kv_demotions: int = 0  # host -> disk
    num_kv_promotions: int = 0  # disk -> host
    num_kv_failed_promotions: int = 0  # a missing, torn, corrupt or foreign disk file
    num_kv_tier_evictions: int = 0  # left the last tier
    kv_tier_saved_s: float = 0.0  # prefill time the host hits saved (SchedulerStats)
    # What a tier hit costs here, as measured (0: not yet): seconds to load one block from
    # host and to read one back from disk (a hit saves prefill_s_per_token a token)
    kv_host_load_s: float = 0.0
    kv_disk_load_s: float = 0.0
    # Prompt tokens pulled from another decode worker, and those whose pull failed (computed
    # here after all): SchedulerStats
    num_pulled_tokens: int = 0
    num_failed_pull_tokens: int = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def kv_tier_counts(self) -> dict[str, float]:
        """The KV tier fields by name, as WorkerLoad takes them."""
        return {name: getattr(self, name) for name in KV_TIER_FIELDS}

    def step_counts(self) -> dict[str, float]:
        """Its steps' fields by name, as WorkerLoad takes them."""
        return {name: getattr(self, name) for name in STEP_FIELDS}

    @classmethod
    def from_core(cls, core: EngineCore, num_reserved: int = 0) -> WorkerStats:
        kv, scheduler, config = core.kv_cache, core.scheduler, core.config
        return cls(
            num_blocks=kv.pool.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_cached_blocks=kv.pool.num_cached_blocks,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_reserved=num_reserved,
            num_computed_tokens=scheduler.stats.num_computed_tokens,
            max_num_seqs=config.scheduler.max_num_seqs,
            block_size=config.cache.block_size,
            tp_size=core.tp.size,
            num_spec_verifications=scheduler.stats.num_spec_verifications,
            num_draft_tokens=scheduler.stats.num_draft_tokens,
            num_accepted_tokens=scheduler.stats.num_accepted_tokens,
            quantization=config.model.quantization.method if config.model.quantization else "",
            weight_bytes=core.runner.weight_bytes,
            lora_adapters=core.runner.loras.loaded if core.runner.loras is not None else (),
            step_token_budget=scheduler.step_token_budget(),
            prefill_s_per_token=fit.per_token_s if (fit := scheduler.step_time.fit()) else 0.0,
            step_intercept_s=fit.intercept_s if fit else 0.0,
            step_slope_fitted=scheduler.step_time.slope_fitted,
            decode_s_per_token=fit.decode_s if fit and scheduler.step_time.decode_slope_fitted
            else 0.0,
            num_prefill_tokens=scheduler.num_prefill_tokens(),
            num_pulled_tokens=scheduler.stats.num_pulled_tokens,
            num_failed_pull_tokens=scheduler.stats.num_failed_pull_tokens,
            **_tier_counts(core),
        )


def _tier_counts(core: EngineCore) -> dict[str, float]:
    """WorkerStats' KV tier fields; none (their defaults, 0) without tiers."""
    tiers = core.kv_cache.tiers
    if tiers is None:
        return {}
    s = tiers.stats
    return {
        "kv_block_bytes": core.runner.offload.block_nbytes,
        "num_kv_host_blocks": tiers.num_host_blocks,
        "num_kv_disk_blocks": tiers.num_disk_blocks_held,
        "num_kv_host_hits": s.host_hits,
        "num_kv_disk_hits": s.disk_hits,
        "num_kv_stores": s.stores,
        "num_kv_demotions": s.demotions,
        "num_kv_promotions": s.promotions,
        "num_kv_failed_promotions": s.failed_promotions,
        "num_kv_tier_evictions": s.evictions,
        "kv_tier_saved_s": core.scheduler.stats.tier_saved_s,
        "kv_host_load_s": core.runner.offload.host_load_s or 0.0,
        "kv_disk_load_s": core.runner.offload.disk_load_s or 0.0,
    }
