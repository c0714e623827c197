"""Disaggregation: whether a prompt is prefilled on a prefill worker (remote) or on the decode
worker chosen for it (local, in chunks between its decode steps), from measured costs.

Remote prefill leaves the decode batch alone but waits behind the prefill worker's queue;
local prefill skips that queue and the KV transfer but stretches the decode batch's steps
while it runs. Which one pays changes with load (DistServe, Splitwise): a fixed rule loses
either TTFT when the prefill pool is the bottleneck or TPOT when the decode batch is full.
So the choice is made per request from each worker's own fit of step time against tokens
(engine.step_budget: a step of p prompt and d decode tokens lasts `intercept_s + per_token_s *
p + per_decode_s * d`), the tokens
queued on each, and the prompt's cached part on each. A prefill worker's KV push lies inside
its timed step (layer by layer, the step ends once every byte is acknowledged), so its fit
prices the transfer too; adding a separate per-byte term would count the bytes twice.

Predictions, for a prompt with U uncached tokens on a worker that has Q queued ahead of it:
- remote on P: Q + U tokens at P's line, in steps of P's budget;
- local on D, with R sequences decoding there: Q + U tokens in chunks of (budget - R) beside
  R decode tokens a step, after the prefix it pulls has landed (when it pulls one). Those
  steps are the batch's TPOT while it runs; over the whole prefill every running sequence
  waits (Q + U) * per_token_s longer.

The rule, in order:
1. Until some worker has a fit, the fixed rule decides (`fallback_local`: the session's
   decode worker prefills a short uncached tail itself). A worker without a fit of its own
   is priced at another's (the same model on both; its own first steps correct it), and a
   decode worker that never prefilled a prompt at the prefill worker's prompt slope beside
   its own fixed and decode costs (router.placement).
2. Local when it is predicted to give the first token sooner and to keep the batch within the
   TPOT SLO (any step length with nobody decoding there) or, without a TPOT SLO, when what it
   saves this request exceeds what it costs the batch (R times its compute).
3. Otherwise remote: the request queues at the prefill worker (the one router.policy's
   choose_prefill picks: least uncached work), whose own queue orders it (shortest remaining
   prefill first).
Pure: no I/O; the placer gathers the numbers and applies the decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.engine.step_budget import StepFit

REMOTE, LOCAL = "remote", "local"
# why a decision went the way it did (a metric label)
REASONS = ("unmeasured", "sooner", "spares_decode", "tpot_slo")


@dataclass(frozen=True)
class StepCost:
    """A worker's steps: the fitted line (a step of n tokens lasts `fit.seconds(n)`) and the
    most tokens one step takes."""

    fit: StepFit
    budget: int

    def __post_init__(self) -> None:
        if not (self.fit.intercept_s >= 0 and self.fit.per_token_s > 0 and self.budget > 0
                and math.isfinite(self.fit.intercept_s + self.fit.per_token_s)):
            raise ValueError(f"a step cost needs intercept_s >= 0, per_token_s > 0 and "
                             f"budget > 0, got {self}")

    def prefill_s(self, num_tokens: int, num_decoding: int = 0) -> float:
        """Seconds to compute `num_tokens` prompt tokens in chunks beside `num_decoding`
        decode tokens a step (each step takes at least one prompt token)."""
        if num_tokens <= 0:
            return 0.0
        steps = -(-num_tokens // self.chunk(num_decoding))
        decode_s = self.fit.seconds(num_decoding, num_decoding)  # a step's decodes (and fixed)
        return steps * decode_s + self.fit.per_token_s * num_tokens

    def chunk(self, num_decoding: int) -> int:
        """Prompt tokens a step takes beside `num_decoding` decodes."""
        return max(self.budget - num_decoding, 1)


@dataclass(frozen=True)
class Option:
    """A worker a prompt may be prefilled on: prompt tokens queued there ahead of it, this
    prompt's tokens it does not hold, sequences decoding there (0 on a prefill worker), its
    step-time line (None: not fitted yet), its step budget in tokens, and the seconds before
    it can start (a prefix it pulls from another decode worker, at the pulls' measured cost)."""

    worker_id: str
    num_queued_tokens: int
    num_uncached_tokens: int
    fit: StepFit | None
    budget: int
    num_decoding: int = 0
    wait_s: float = 0.0

    @property
    def work(self) -> int:
        return self.num_queued_tokens + self.num_uncached_tokens

    def cost(self, borrowed: StepFit | None) -> StepCost | None:
        """Its own line, else `borrowed` (another worker's), at its own budget."""
        fit = self.fit or borrowed
        return None if fit is None else StepCost(fit, self.budget)


@dataclass(frozen=True)
class Decision:
    """Where the prompt is prefilled (REMOTE: on `worker_id`, a prefill worker; LOCAL: on
    `worker_id`, the decode worker), why, and the predicted TTFT and decode-batch TPOT of that
    choice (None where nothing was measured)."""

    where: str
    worker_id: str
    reason: str
    ttft_s: float | None = None
    tpot_s: float | None = None


def decide(remote: Option, local: Option, fallback_local: bool,
           tpot_slo_s: float | None = None) -> Decision:
    """Remote or local prefill for one prompt (the module doc's rule). `remote`: the prefill
    worker chosen for it (router.policy.choose_prefill); `local`: the decode worker chosen for
    it; `fallback_local`: the fixed rule's answer, used until either is measured; the TPOT SLO
    in seconds (None: none)."""
    local_cost = local.cost(remote.fit)
    if local_cost is None:
        chosen = local if fallback_local else remote
        return Decision(LOCAL if fallback_local else REMOTE, chosen.worker_id, "unmeasured")
    decoding = local.num_decoding
    remote_ttft = remote.wait_s + remote.cost(local_cost.fit).prefill_s(remote.work)
    local_ttft = local.wait_s + local_cost.prefill_s(local.work, decoding)
    fit = local_cost.fit
    remote_tpot = fit.seconds(decoding + 1, decoding + 1)
    chunk = min(local.work, local_cost.chunk(decoding))
    local_tpot = fit.seconds(decoding + chunk, decoding) if decoding else remote_tpot

    def go_remote(reason: str) -> Decision:
        return Decision(REMOTE, remote.worker_id, reason, remote_ttft, remote_tpot)

    if local_ttft >= remote_ttft:
        return go_remote("sooner")
    if tpot_slo_s is not None:
        if decoding and local_tpot > tpot_slo_s:
            return go_remote("tpot_slo")
    elif remote_ttft - local_ttft <= decoding * fit.per_token_s * local.work:
        return go_remote("spares_decode")
    return Decision(LOCAL, local.worker_id, "sooner", local_ttft, local_tpot)
