"""WorkerStats: a worker's load, as its gRPC service reports it (proto/worker.proto WorkerLoad).

One message for both roles: a prefill worker reserves nothing (nor speculates) and a decode
worker's `num_computed_tokens` counts its local prefills. The speculative decoding counts are
cumulative since the worker started (acceptance rate = accepted / draft tokens; mean accepted
length = (accepted + verifications) / verifications, the tokens one verification emits).
Read on the engine's loop thread, or as a racy-but-harmless snapshot from another one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)


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
    step_token_budget: int = 0  # what its next step may compute (Scheduler.step_token_budget)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

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
        )
