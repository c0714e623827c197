"""`PerfModel`: what one prefill worker and one decode worker can do, as a few numbers.

- Prefill: `prefill_tokens_per_s` prompt tokens per second per worker, so a prompt of n tokens
  takes n / prefill_tokens_per_s seconds (prefill is compute-bound: time ~ tokens).
- Decode: one continuous-batching step that advances `batch` sequences of mean context
  `context` tokens by one token each takes

      step_s = a + b * batch + c * batch * context

  a: the fixed cost of a step (weights streamed once, launch overheads); b: per sequence
  (its MLP/projection rows); c: per cached token read by attention. `fit_decode` finds a, b, c
  by least squares over profiled points, constrained to be >= 0 (a negative coefficient is
  noise and would predict negative step times).

The capacities the planner sizes workers by are here too, so they are tested with the model:
`prefill_capacity` (tokens/s one worker sustains while the mean TTFT stays under a target) and
`decode_capacity` (sequences one worker batches while the step time stays under a target).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PerfModel:
    """Per-worker performance; `source` says where the numbers came from (model, threads)."""

    prefill_tokens_per_s: float
    decode_a_s: float
    decode_b_s: float = 0.0
    decode_c_s: float = 0.0
    source: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        r = self.prefill_tokens_per_s
        if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
            raise ValueError(f"prefill_tokens_per_s must be a positive number, got {r!r}")
        for name in ("decode_a_s", "decode_b_s", "decode_c_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.decode_a_s + self.decode_b_s + self.decode_c_s <= 0:
            raise ValueError("decode step time is zero for every batch: give decode_a_s > 0")
        object.__setattr__(self, "source", dict(self.source))

    def prefill_time(self, num_tokens: int) -> float:
        """Seconds one worker needs to prefill a prompt of `num_tokens` tokens."""
        return num_tokens / self.prefill_tokens_per_s

    def decode_step_time(self, batch: int, context: float) -> float:
        """Seconds of one decode step of `batch` sequences of mean context `context` tokens."""
        if batch <= 0:
            return 0.0
        return self.decode_a_s + self.decode_b_s * batch + self.decode_c_s * batch * context

    def prefill_capacity(self, input_tokens: float, ttft_target_s: float) -> float:
        """Prompt tokens/s one worker sustains with mean TTFT <= `ttft_target_s`.

        A prefill worker is a queue with service time S = input / rate; with Poisson arrivals
        and a fixed S (M/D/1) the mean wait is rho * S / (2 * (1 - rho)) (Pollaczek-Khinchine),
        so wait + S <= T holds up to utilisation rho = 2 (T - S) / (2 T - S). When even an
        idle worker misses T (S >= T) no utilisation meets it; we then size for throughput
        alone (rho = 1): more workers cannot make one prompt faster.
        """
        s = self.prefill_time(max(input_tokens, 1.0))
        rho = 1.0 if s >= ttft_target_s else 2 * (ttft_target_s - s) / (2 * ttft_target_s - s)
        return rho * self.prefill_tokens_per_s

    def decode_capacity(self, context: float, itl_target_s: float) -> float:
        """Sequences one worker batches with step time <= `itl_target_s` at mean `context`.

        Solves a + (b + c * context) * batch = target for batch (>= 1: a worker always runs
        at least one sequence, however slow; inf when the step does not grow with the batch).
        """
        per_seq = self.decode_b_s + self.decode_c_s * context
        if per_seq <= 0:
            return math.inf
        return max(1.0, (itl_target_s - self.decode_a_s) / per_seq)

    # -- JSON ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PerfModel:
        known = {"prefill_tokens_per_s", "decode_a_s", "decode_b_s", "decode_c_s", "source"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"perf model: unknown keys {unknown}; expected {sorted(known)}")
        if "prefill_tokens_per_s" not in data or "decode_a_s" not in data:
            raise ValueError("perf model needs prefill_tokens_per_s and decode_a_s")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        logger.info("wrote %s", path)

    @classmethod
    def load(cls, path: str | Path) -> PerfModel:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)


def fit_decode(points: Sequence[tuple[int, float, float]]) -> tuple[float, float, float]:
    """(a, b, c) >= 0 minimising the squared error of a + b*batch + c*batch*context over
    (batch, context, step_s) points.

    Non-negative least squares, exactly, by trying every subset of free coefficients (2^3 small
    problems) and keeping the best feasible one.
    """
    if len(points) < 1:
        raise ValueError("fit_decode needs at least one (batch, context, step_s) point")
    x = np.array([[1.0, b, b * c] for b, c, _ in points])
    y = np.array([s for _, _, s in points])
    best, best_err = (float(np.mean(y)), 0.0, 0.0), math.inf
    for free in itertools.chain.from_iterable(
        itertools.combinations(range(3), k) for k in (1, 2, 3)
    ):
        cols = list(free)
        sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if np.any(sol < 0):
            continue
        coef = np.zeros(3)
        coef[cols] = sol
        err = float(np.sum((x @ coef - y) ** 2))
        if err < best_err - 1e-18:
            best, best_err = (float(coef[0]), float(coef[1]), float(coef[2])), err
    return best
