"""When speculation pays: a measured cost model of a step against measured acceptance.

The rule, per step, for the B sequences that are one token behind, with k_i drafts for
sequence i (K = sum of k_i): speculate iff

    (B + sum_i E(k_i)) / (t(B + K) + P)  >=  B / t(B)

(tokens per second with drafts >= without), where t(T) = a + b*T is the step's time for T
tokens, fitted online over every step (exponentially weighted least squares); E(k) =
alpha (1 - alpha^k) / (1 - alpha) is the expected run of accepted drafts out of k when each
holds with probability alpha, the acceptance rate measured over recent speculative steps; and
P is the time proposing costs. A cheap proposer (n-gram lookup) proposes first and the rule
judges the actual drafts (P = 0: already spent); a draft model is judged before it runs, with
k_i = num_speculative_tokens and P its measured mean. Until the fit and alpha are known it
speculates. While it does not, a probe step speculates anyway, so alpha follows the text as
it changes: after PROBE_EVERY steps off, then twice as many after each probe the rule did not
call for, up to MAX_PROBE_EVERY (a draft model catches up on every token since its last
proposal, so probes that keep failing get rarer). Pure arithmetic, no clock: the engine
passes the seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DECAY = 0.97  # weight of the past per observation (~33 steps)
PROBE_EVERY = 16
MAX_PROBE_EVERY = 512


@dataclass
class StepCost:
    """seconds = a + b * tokens, least squares over exponentially decayed observations."""

    s0: float = 0.0
    s1: float = 0.0
    s2: float = 0.0
    sy: float = 0.0
    s1y: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = DECAY
        self.s0 = d * self.s0 + 1.0
        self.s1 = d * self.s1 + tokens
        self.s2 = d * self.s2 + tokens * tokens
        self.sy = d * self.sy + seconds
        self.s1y = d * self.s1y + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b), both >= 0; None until two step sizes have been seen."""
        var = self.s0 * self.s2 - self.s1 * self.s1
        if var <= 1e-9 * max(self.s0 * self.s2, 1e-30):
            return None
        b = max((self.s0 * self.s1y - self.s1 * self.sy) / var, 0.0)
        a = max((self.sy - b * self.s1) / self.s0, 0.0)
        return a, b


def expected_accepted(alpha: float, k: int) -> float:
    """Mean length of the run of accepted drafts among k, each holding with `alpha`."""
    return float(k) if alpha >= 1.0 else alpha * (1.0 - alpha**k) / (1.0 - alpha)


@dataclass
class SpecPolicy:
    cost: StepCost
    alpha: float | None = None  # drafts accepted / drafts verified, recent speculative steps
    propose_s: float | None = None  # P of a proposer judged before it runs
    steps_off: int = 0
    probe_every: int = PROBE_EVERY

    def should_speculate(self, num_seqs: int, drafts: Sequence[int],
                         propose_s: float = 0.0) -> bool:
        """Whether verifying `drafts` (one count per drafted sequence) among `num_seqs`
        one-token-behind sequences, after `propose_s` more seconds of proposing, pays; or
        whether this step probes."""
        fit = self.cost.fit()
        if fit is None or self.alpha is None:
            return True
        a, b = fit
        gain = sum(expected_accepted(self.alpha, k) for k in drafts)
        with_drafts = a + b * (num_seqs + sum(drafts)) + propose_s
        if (num_seqs + gain) * (a + b * num_seqs) >= num_seqs * with_drafts:
            self.probe_every = PROBE_EVERY
            return True
        if self.steps_off + 1 >= self.probe_every:
            self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
            return True
        return False

    def record(self, num_drafts: int, num_accepted: int, propose_s: float | None = None) -> None:
        """After a step: the drafts it verified (0: it did not speculate), those accepted,
        and for a proposer judged before it runs, the seconds it took."""
        if not num_drafts:
            self.steps_off += 1
            return
        self.steps_off = 0
        self.alpha = _ema(self.alpha, num_accepted / num_drafts)
        if propose_s is not None:
            self.propose_s = _ema(self.propose_s, propose_s)


def _ema(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new
