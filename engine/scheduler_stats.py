"""SchedulerStats: what a scheduler has done, as cumulative counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_computed_tokens: int = 0  # tokens run through the model, all steps
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    num_steps: int = 0
    # Speculative decoding: one verification = one sequence's drafts checked in one step.
    num_spec_verifications: int = 0
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted (each verification also emits one more)
