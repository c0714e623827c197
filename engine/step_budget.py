"""Step budget: how many tokens a step may take to last about a target time, and the order
in which waiting prompts are admitted (shortest remaining prefill first, with aging).

A token budget alone lets one step prefill a whole burst of prompts: the first prompt's first
token then waits for all of them. Sizing steps in seconds needs a model of a step's wall time;
`StepTimeModel` fits `seconds = a + b * tokens` online (least squares, old steps forgotten
geometrically so the fit follows load and clock changes), and the pure functions below turn a
fit into a budget and an admission order. No torch, no I/O: the scheduler owns the model and
feeds it the engine's timings.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pdserve.engine.request import RequestStatus

logger = logging.getLogger(__name__)

# Tokens per second assumed before any fit exists (only the admission order uses it, and only
# to weigh prompt length against waiting time until a couple of steps have been timed).
FALLBACK_TOKENS_PER_S = 10_000.0
# A step's budget before anything was timed: small, so that a fresh worker's first burst is
# not one long step, and a first timing comes soon.
COLD_START_TOKENS = 256
# The slope is fitted only while recent step sizes spread this much (standard deviation over
# mean): steps of nearly one size (a steady stream of budget-sized prefill chunks) say little
# about it, and timing noise over a narrow range would swing it, and the budget with it.
_MIN_SIZE_SPREAD = 0.1


@dataclass(frozen=True)
class StepFit:
    """A step of `n` tokens lasts about `intercept_s + per_token_s * n` seconds."""

    intercept_s: float
    per_token_s: float

    def seconds(self, num_tokens: int) -> float:
        return self.intercept_s + self.per_token_s * num_tokens


class StepTimeModel:
    """Online least-squares line through (tokens, seconds) of past steps, each older step
    weighing `decay` times the next (0.9: the last ~10 steps dominate).

    Kept as exponentially weighted means and centred second moments (Welford's update), which
    stay accurate where raw sums of squares would cancel. A slope needs steps of clearly
    different sizes; until then the fit is the mean cost per token (a line through the origin,
    so budgets start small rather than large). While recent steps are all about one size the
    last slope is kept and only the intercept follows, through the recent mean: budgets then
    converge on the target (a step that ran long shrinks the next).
    """

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        self.decay = decay
        self._weight = 0.0
        self._mean_tokens = 0.0
        self._mean_seconds = 0.0
        self._var_tokens = 0.0  # weighted sum of squared token deviations
        self._cov = 0.0  # weighted sum of token x seconds deviations
        self._slope: float | None = None  # set once sizes were spread enough
        self._fit: StepFit | None = None
        self.num_observations = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step computed `num_tokens` tokens in `seconds`; empty or unmeasurable steps
        (no tokens, a negative or non-finite time) teach nothing and are ignored."""
        if num_tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        self.num_observations += 1
        self._weight = self.decay * self._weight + 1.0
        d_tokens = num_tokens - self._mean_tokens
        self._mean_tokens += d_tokens / self._weight
        self._mean_seconds += (seconds - self._mean_seconds) / self._weight
        self._var_tokens = self.decay * self._var_tokens + d_tokens * (
            num_tokens - self._mean_tokens)
        self._cov = self.decay * self._cov + d_tokens * (seconds - self._mean_seconds)
        self._refit()

    def _refit(self) -> None:
        variance = self._var_tokens / self._weight
        if variance > (_MIN_SIZE_SPREAD * self._mean_tokens) ** 2:
            self._slope = self._cov / self._var_tokens
        if self._slope is not None:
            intercept = self._mean_seconds - self._slope * self._mean_tokens
            self._fit = StepFit(intercept, self._slope)
        else:  # one size so far: the mean cost per token, no intercept (over-estimates)
            self._fit = StepFit(0.0, self._mean_seconds / self._mean_tokens)

    @property
    def slope_fitted(self) -> bool:
        """Whether the line's slope comes from steps of clearly different sizes (else it is
        the mean cost per token: what a step of the usual size costs, not a marginal rate)."""
        return self._slope is not None

    def fit(self) -> StepFit | None:
        """The current line: through the origin and the mean step until steps of clearly
        different sizes were timed; None before any step was."""
        return self._fit


def token_budget(fit: StepFit | None, target_s: float, floor: int, cap: int) -> int:
    """The tokens a step can take to last about `target_s` on the fitted line, in
    [floor, cap] (cap wins if floor > cap).

    `floor` keeps every step making progress however slow the fit says steps are. With no fit
    yet, COLD_START_TOKENS; a line that does not grow with tokens sizes nothing: `cap`.
    """
    if fit is None:
        return min(cap, max(floor, COLD_START_TOKENS))
    if not fit.per_token_s > 0:
        return cap
    tokens = (target_s - fit.intercept_s) / fit.per_token_s
    return min(cap, max(floor, math.floor(tokens)))


def tokens_per_s(fit: StepFit | None) -> float:
    """The marginal prefill rate the fit implies (its slope), or a fixed fallback."""
    if fit is None or not fit.per_token_s > 0:
        return FALLBACK_TOKENS_PER_S
    return 1.0 / fit.per_token_s


def srpt_key(num_remaining_tokens: int, waited_s: float, rate: float) -> float:
    """Seconds of prefill work left minus seconds waited: smaller goes first. A request that
    has waited longer than its own work beats any newcomer, so none starves."""
    return num_remaining_tokens / rate - waited_s


class WaitingRequest(Protocol):
    """What the ordering reads of a queued request (engine.request.Request is one)."""

    status: RequestStatus
    arrival_time: float  # time.monotonic() when it arrived
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...


R = TypeVar("R", bound=WaitingRequest)


def srpt_order(waiting: Sequence[R], now: float, rate: float) -> list[R]:
    """The waiting queue in admission order: preempted requests first, as they were (they
    already held blocks and lost them), then the rest by `srpt_key`, ties by arrival then by
    their current place (FCFS).

    Prefix-cache hits are not subtracted from the work (looking them up for every waiting
    request each step costs more than the ordering is worth). Since `now` is common to all,
    the order is that of `arrival_time + work`: it changes only as the rate does.
    """
    preempted = [r for r in waiting if r.status is RequestStatus.PREEMPTED]
    rest = [r for r in waiting if r.status is not RequestStatus.PREEMPTED]
    rest.sort(key=lambda r: (
        srpt_key(r.num_tokens - r.num_computed_tokens, now - r.arrival_time, rate),
        r.arrival_time))
    return preempted + rest
