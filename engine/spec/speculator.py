"""Speculator: after each step, proposes the next step's drafts when the policy says it pays.

It owns the proposer and the policy; the scheduler takes each request's `spec_token_ids` into
its next plan, the runner verifies them (engine.spec.verify). Runs where the scheduler runs
(rank 0 of a tensor-parallel group).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.policy import SpecPolicy, StepCost


class Proposer(Protocol):
    # True: proposing costs next to nothing (n-gram lookup), so the policy judges the actual
    # drafts after it; False: it runs a model, so the policy judges before it runs.
    cheap: bool

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> None:
        """Set each request's `spec_token_ids`: at most its `num_drafts` tokens."""

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop what is kept for finished requests."""


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.policy = SpecPolicy(StepCost())
        self._propose_s: float | None = None  # the costly proposer's time for the plan in flight
        self._seen = (0, 0)  # the scheduler's (draft, accepted) totals at the last step

    def after_step(self, plan: SchedulerOutput, seconds: float, scheduler: Scheduler) -> None:
        """`seconds`: how long `plan` took to run. Proposes drafts for the next plan."""
        self.proposer.forget(plan.finished_request_ids)
        if plan.requests:
            self.policy.cost.observe(plan.total_num_tokens, seconds)
        drafts, accepted = scheduler.stats.num_draft_tokens, scheduler.stats.num_accepted_tokens
        self.policy.record(drafts - self._seen[0], accepted - self._seen[1], self._propose_s)
        self._seen, self._propose_s = (drafts, accepted), None
        ready = [r for r in scheduler.running if r.num_computed_tokens == r.num_tokens - 1]
        caps = [self._max_drafts(r) for r in ready]
        ready, caps = [r for r, k in zip(ready, caps) if k > 0], [k for k in caps if k > 0]
        if not ready:
            return
        if self.proposer.cheap:
            self.proposer.propose(ready, caps)
            drafted = [len(r.spec_token_ids) for r in ready if r.spec_token_ids]
            if drafted and not self.policy.should_speculate(len(ready), drafted):
                for r in ready:
                    r.spec_token_ids.clear()
        elif self.policy.should_speculate(len(ready), caps, self.policy.propose_s or 0.0):
            start = time.perf_counter()
            self.proposer.propose(ready, caps)
            self._propose_s = time.perf_counter() - start

    def _max_drafts(self, request: Request) -> int:
        """Drafts worth verifying: no more than could still be emitted (the target's own
        token comes after them) or fit the context window."""
        left = request.sampling_params.max_tokens - len(request.output_token_ids) - 1
        room = self.max_model_len - request.num_tokens
        return min(self.config.num_speculative_tokens, left, room)
