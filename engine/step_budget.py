"""Step budget: how many tokens a step may take to last about a target time, and the order
in which waiting prompts are admitted (shortest remaining prefill first, with aging).

A token budget alone lets one step prefill a whole burst of prompts: the first prompt's first
token then waits for all of them. Sizing steps in seconds needs a model of a step's wall time;
`StepTimeModel` fits `seconds = a + bp * prompt tokens + bd * decode tokens` online (least
squares, old steps forgotten geometrically so the fit follows load and clock changes), and the
pure functions below turn a fit into a budget and an admission order. No torch, no I/O: the
scheduler owns the model and feeds it the engine's timings.
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
# Prompt and decode sizes are fitted apart only while they are this far from moving together
# (1 - their correlation squared): else one slope serves both.
_MIN_INDEPENDENCE = 0.05


@dataclass(frozen=True)
class StepFit:
    """A step of `p` prompt tokens and `d` decode tokens lasts about `intercept_s +
    per_token_s * p + per_decode_s * d` seconds (`per_decode_s` None: as a prompt token)."""

    intercept_s: float
    per_token_s: float
    per_decode_s: float | None = None

    @property
    def decode_s(self) -> float:
        return self.per_token_s if self.per_decode_s is None else self.per_decode_s

    def seconds(self, num_tokens: int, num_decodes: int = 0) -> float:
        """A step of `num_tokens` tokens, `num_decodes` of them decode tokens."""
        return (self.intercept_s + self.per_token_s * (num_tokens - num_decodes)
                + self.decode_s * num_decodes)


class StepTimeModel:
    """Online least squares of a step's seconds on its prompt tokens and its decode tokens
    (`seconds = a + bp * prompt + bd * decode`), each older step weighing `decay` times the
    next (0.9: the last ~10 steps dominate). The two are fitted apart because they cost
    differently (a decode token reads its whole context; a prompt token shares the weights
    with a chunk of others): a decode worker's decode steps say little of what a prompt
    chunk beside them costs.

    Kept as exponentially weighted means and centred second moments (Welford's update), which
    stay accurate where raw sums of squares would cancel. A slope needs steps of clearly
    different sizes of its kind; until then the fit is the mean cost per token (a line through
    the origin, so budgets start small rather than large). While recent steps are all about
    one size the last slopes are kept and only the intercept follows, through the recent
    means: budgets then converge on the target (a step that ran long shrinks the next). A
    kind whose slope was never fitted is priced as the other kind; prompt and decode sizes
    that always move together are fitted as one kind.
    """

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        self.decay = decay
        self._weight = 0.0
        self._mean = [0.0, 0.0]  # prompt, decode tokens
        self._mean_seconds = 0.0
        self._m2 = [[0.0, 0.0], [0.0, 0.0]]  # weighted sums of token deviation products
        self._cov = [0.0, 0.0]  # ... of token x seconds deviations
        self._slopes: list[float | None] = [None, None]  # set once sizes spread enough
        self._fit: StepFit | None = None
        self.num_observations = 0

    def observe(self, num_tokens: int, seconds: float, num_decodes: int = 0) -> None:
        """One step computed `num_tokens` tokens (`num_decodes` of them one-token decodes)
        in `seconds`; empty or unmeasurable steps (no tokens, a negative or non-finite time)
        teach nothing and are ignored."""
        if num_tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        num_decodes = min(max(num_decodes, 0), num_tokens)
        x = (num_tokens - num_decodes, num_decodes)
        self.num_observations += 1
        self._weight = self.decay * self._weight + 1.0
        dx = [x[i] - self._mean[i] for i in range(2)]
        for i in range(2):
            self._mean[i] += dx[i] / self._weight
        self._mean_seconds += (seconds - self._mean_seconds) / self._weight
        for i in range(2):
            for j in range(2):
                self._m2[i][j] = self.decay * self._m2[i][j] + dx[i] * (x[j] - self._mean[j])
            self._cov[i] = self.decay * self._cov[i] + dx[i] * (seconds - self._mean_seconds)
        self._refit()

    def _spread(self, i: int) -> bool:
        mean = self._mean[i]
        return mean > 0 and self._m2[i][i] / self._weight > (_MIN_SIZE_SPREAD * mean) ** 2

    def _refit(self) -> None:
        m2, cov = self._m2, self._cov
        spread = [self._spread(0), self._spread(1)]
        if all(spread):
            det = m2[0][0] * m2[1][1] - m2[0][1] ** 2
            if det > _MIN_INDEPENDENCE * m2[0][0] * m2[1][1]:
                self._slopes = [(cov[0] * m2[1][1] - cov[1] * m2[0][1]) / det,
                                (cov[1] * m2[0][0] - cov[0] * m2[0][1]) / det]
            else:  # the two sizes move together: one slope for both
                both = (cov[0] + cov[1]) / (m2[0][0] + 2 * m2[0][1] + m2[1][1])
                self._slopes = [both, both]
        else:
            for i in (0, 1):
                if spread[i]:
                    self._slopes[i] = cov[i] / m2[i][i]
        prompt, decode = self._slopes
        if prompt is None and decode is None:  # one size so far: the mean cost per token
            self._fit = StepFit(0.0, self._mean_seconds / sum(self._mean))
            return
        prompt = decode if prompt is None else prompt
        decode = prompt if decode is None else decode
        intercept = self._mean_seconds - prompt * self._mean[0] - decode * self._mean[1]
        self._fit = StepFit(intercept, prompt, decode)

    @property
    def slope_fitted(self) -> bool:
        """Whether the prompt tokens' slope comes from steps of clearly different prompt sizes
        (else it is the decode tokens' slope, or the mean cost per token)."""
        return self._slopes[0] is not None

    @property
    def decode_slope_fitted(self) -> bool:
        """Whether the decode tokens' slope was fitted (else it is the prompt tokens')."""
        return self._slopes[1] is not None

    def fit(self) -> StepFit | None:
        """The current fit: through the origin and the mean step until steps of clearly
        different sizes were timed; None before any step was."""
        return self._fit


def token_budget(fit: StepFit | None, target_s: float, floor: int, cap: int,
                 num_decodes: int = 0) -> int:
    """The tokens a step can take to last about `target_s` on the fitted line, `num_decodes`
    of them the running decodes' and the rest prompt tokens, in [floor, cap] (cap wins if
    floor > cap).

    `floor` keeps every step making progress however slow the fit says steps are. With no fit
    yet, COLD_START_TOKENS; a line that does not grow with prompt tokens sizes nothing: `cap`.
    """
    if fit is None:
        return min(cap, max(floor, COLD_START_TOKENS))
    if not fit.per_token_s > 0:
        return cap
    left = target_s - fit.seconds(num_decodes, num_decodes)
    tokens = num_decodes + left / fit.per_token_s
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
