"""Speculative decoding over one benchmark run, from the router's /metrics before and after it.

The decode workers' counters (router/metrics_speculation.py) are cumulative, one series per
worker. A worker's increase over the run is `after - before`, or `after` when its counter
went down (the worker restarted meanwhile), as Prometheus's `increase()` reads a reset; a
worker that left during the run counts nothing. Over the run's sums:

- acceptance rate = accepted / draft tokens;
- mean accepted length = (accepted + verifications) / verifications: the tokens one
  verification emitted, the target's own token included (vLLM's "mean acceptance length").

No verification during the run means the deployment does not speculate: nothing is reported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

VERIFICATIONS = "pdserve_spec_verifications_total"
DRAFT_TOKENS = "pdserve_spec_draft_tokens_total"
ACCEPTED_TOKENS = "pdserve_spec_accepted_tokens_total"


@dataclass(frozen=True)
class SpeculationDelta:
    """What every decode worker's speculation counted during one run."""

    num_verifications: float
    num_draft_tokens: float
    num_accepted_tokens: float

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.num_accepted_tokens + self.num_verifications) / self.num_verifications

    def to_dict(self) -> dict[str, float]:
        return {"num_verifications": self.num_verifications,
                "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length}


def speculation_between(before: str | None, after: str | None) -> SpeculationDelta | None:
    """The run's speculation from two scrapes; None without both, or when nothing was verified."""
    if before is None or after is None:
        return None
    verifications, drafts, accepted = (_increase(before, after, name)
                                       for name in (VERIFICATIONS, DRAFT_TOKENS, ACCEPTED_TOKENS))
    if verifications <= 0:
        return None
    return SpeculationDelta(verifications, drafts, accepted)


def format_speculation(delta: SpeculationDelta) -> str:
    """One line for the bench's output."""
    d = delta
    return (f"speculative decoding: acceptance rate {d.acceptance_rate:.1%} "
            f"({d.num_accepted_tokens:.0f} of {d.num_draft_tokens:.0f} draft tokens), mean "
            f"accepted length {d.mean_accepted_length:.2f} tokens per verification "
            f"({d.num_verifications:.0f} verifications)")


def _increase(before: str, after: str, name: str) -> float:
    start = _per_worker(before, name)
    return sum(value - start.get(worker, 0.0) if value >= start.get(worker, 0.0) else value
               for worker, value in _per_worker(after, name).items())


def _per_worker(text: str, name: str) -> dict[str, float]:
    return {sample.labels.get("worker", ""): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name}
