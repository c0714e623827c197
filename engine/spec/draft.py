"""Draft-model proposals: a small model with the target's tokenizer, run greedily by the same
worker (rank 0 of a tensor-parallel group, unsharded) with its own weights and KV tensors.

Its KV lives in the target's blocks: the same block ids index a second set of per-layer
tensors, so the target's block tables serve both models and a request's blocks are sized for
both (engine.spec.make.sized). The draft's KV of a request is valid for the positions it has
computed that the target has kept; each proposal first catches the draft up on the rest (the
whole prompt for a new request, the accepted tokens after a verification), then runs one
single-token step per further draft.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)


class DraftProposer:
    cheap = False

    def __init__(self, config: EngineConfig, draft: ModelConfig, kv_cache: KVCacheManager):
        """`config`: the target engine's, its cache already sized for both models. The draft
        runs without the target's LoRA adapters (it only proposes: the target verifies with
        them)."""
        self.runner = ModelRunner(replace(config, model=draft, speculative=None, num_threads=None,
                                          lora=None))
        self.kv_cache = kv_cache
        self._done: dict[str, int] = {}  # request id -> leading positions the draft computed

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> None:
        # Room for the drafts' KV in the target's blocks: the target verifies them next step.
        batch = [(r, k) for r, k in zip(requests, num_drafts) if self.kv_cache.allocate(r, k)]
        if not batch:
            return
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in batch}
        entries = []
        for r, _ in batch:
            done = min(self._done.get(r.request_id, 0), r.num_computed_tokens)
            entries.append(self._entry(r, r.token_slice(done, r.num_tokens), done))
        for j in range(max(k for _, k in batch)):
            if j:
                entries = [
                    self._entry(r, (drafts[r.request_id][-1],), r.num_tokens - 1 + j)
                    for r, k in batch if k > j
                ]
            entries.sort(key=lambda e: e.num_tokens != 1)  # decode-shaped first
            sampled = self.runner.execute(SchedulerOutput(tuple(entries))).sampled_token_ids
            for e in entries:
                drafts[e.request_id].append(sampled[e.request_id][0])
                self._done[e.request_id] = e.num_computed_tokens + e.num_tokens
        for r, _ in batch:
            r.spec_token_ids = drafts[r.request_id]

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._done.pop(request_id, None)

    def _entry(self, request: Request, token_ids: Sequence[int], start: int) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tuple(token_ids),
            num_computed_tokens=start,
            block_ids=tuple(self.kv_cache.block_ids(request.request_id)),
            sampling_params=GREEDY,
        )
