"""Serving-benchmark metrics, measured at the client over streamed responses.

Definitions follow vLLM's `bench serve` and genai-perf. For one request r (`RequestRecord`):

- TTFT = first_token_time - start: queueing, prefill, KV transfer and every hop included;
  None when no message carried tokens.
- E2E = end - start (end: the last message, or the error).
- TPOT = (last_token_time - first_token_time) / (num_output_tokens - 1); None with fewer than
  2 output tokens. It equals (E2E - TTFT) / (n - 1) when the last message carries tokens.
- ITL = the per-token gaps after the first token: a message carrying n tokens that arrives
  g seconds after the previous message gives n gaps of g / n; a first message carrying k > 1
  tokens gives k - 1 zeros. A request thus has num_output_tokens - 1 gaps summing to
  last_token_time - first_token_time (their mean is its TPOT). This is exactly how the
  router's `pdserve_inter_token_latency_seconds` histogram counts, so the two compare.

Summary of a run (`summarize`):

- Latency statistics cover successful requests only; failures are counted (`num_errors`,
  `errors_by_code`) and are SLO misses. Requests the client cancelled or aborted on purpose
  (bench/interrupts.py) are neither: they are counted apart (`num_cancelled`, `num_aborted`)
  and left out of latencies, throughputs and SLO attainment. TTFT over ok requests with
  >= 1 token, TPOT over those with >= 2, ITL over every gap of every ok request
  (token-weighted: long answers weigh more, as in vLLM), E2E over all ok requests. Reported
  as mean, p50, p90, p99 in seconds; nan when there is no data.
- Percentiles interpolate linearly between closest ranks (numpy's default "linear"): the
  q-th percentile of sorted x[0..n-1] sits at rank (n - 1) * q / 100.
- Throughputs divide by `duration_s`, which the runner measures (first scheduled send to
  last response): requests/s = ok requests / duration; output tok/s = output tokens of ok
  requests / duration; input tok/s = prompt tokens of ok requests / duration.
- SLO: a request meets it when it succeeded and every given bound holds (value <= bound):
  TTFT (a request with no token misses), TPOT (a request with one token has none and meets
  it), E2E. Goodput = requests meeting the SLO / duration (DistServe; vLLM `--goodput`);
  SLO attainment = requests meeting it / requests not interrupted, errors included as
  misses. Both are None without an SLO.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.bench.trace import RequestRecord

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 99)
_SLO_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s", "e2el": "e2e_s"}


# ---------------------------------------------------------------------------- one request


def ttft(r: RequestRecord) -> float | None:
    first = r.first_token_time
    return None if first is None else first - r.start


def e2e(r: RequestRecord) -> float:
    return r.end - r.start


def tpot(r: RequestRecord) -> float | None:
    n = r.num_output_tokens
    if n < 2:
        return None
    return (r.chunk_times[-1] - r.chunk_times[0]) / (n - 1)


def itls(r: RequestRecord) -> list[float]:
    """num_output_tokens - 1 per-token gaps (see the module docstring)."""
    if not r.chunk_times:
        return []
    gaps = [0.0] * (r.chunk_tokens[0] - 1)
    for prev_t, t, n in zip(r.chunk_times, r.chunk_times[1:], r.chunk_tokens[1:]):
        gaps.extend([(t - prev_t) / n] * n)
    return gaps


# ---------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) with numpy's "linear" method; nan when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    rank = q / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    a, b, t = xs[lo], xs[hi], rank - lo
    # numpy's lerp: from the nearer end, so the result never overshoots b.
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


@dataclass(frozen=True)
class LatencyStats:
    """Mean and percentiles of one latency metric, in seconds (nan when no data)."""

    mean: float
    p50: float
    p90: float
    p99: float


def latency_stats(values: Sequence[float]) -> LatencyStats:
    mean = math.fsum(values) / len(values) if values else math.nan
    p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
    return LatencyStats(mean, p50, p90, p99)


# ---------------------------------------------------------------------------- SLOs


@dataclass(frozen=True)
class SLO:
    """Latency bounds in seconds; None = no bound on that metric."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"SLO {name} must be a positive number of seconds, got {v}")
        if self.ttft_s is None and self.tpot_s is None and self.e2e_s is None:
            raise ValueError("an SLO needs at least one bound (ttft, tpot or e2e)")


def parse_slo(text: str) -> SLO:
    """"ttft=500,tpot=50" (milliseconds; keys ttft, tpot, e2e; ':' and spaces also accepted)."""
    items = [item for item in re.split(r"[,\s]+", text.strip()) if item]
    if not items:
        raise ValueError("empty SLO; expected e.g. 'ttft=500,tpot=50' (milliseconds)")
    bounds: dict[str, float] = {}
    for item in items:
        m = re.fullmatch(r"([A-Za-z0-9_]+)[=:](.*)", item)
        if m is None:
            raise ValueError(f"bad SLO item {item!r}; expected key=milliseconds, e.g. ttft=500")
        key, value = m.group(1).lower(), m.group(2)
        if key not in _SLO_KEYS:
            raise ValueError(f"unknown SLO key {key!r} in {item!r}; use ttft, tpot or e2e")
        field = _SLO_KEYS[key]
        if field in bounds:
            raise ValueError(f"SLO key {key!r} given twice in {text!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"SLO {key} value {value!r} is not a number of milliseconds") from None
        if not (math.isfinite(ms) and ms > 0):
            raise ValueError(f"SLO {key} value {value!r} must be a positive number of milliseconds")
        bounds[field] = ms / 1000
    return SLO(**bounds)


def format_slo(slo: SLO) -> str:
    """The `parse_slo` form, e.g. "ttft=500,tpot=50" (milliseconds)."""
    parts = []
    for key, value in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s), ("e2e", slo.e2e_s)):
        if value is not None:
            parts.append(f"{key}={round(value * 1000, 6):g}")
    return ",".join(parts)


def meets(r: RequestRecord, slo: SLO) -> bool:
    """Whether `r` succeeded within every bound of `slo` (see the module docstring)."""
    if not r.ok:
        return False
    if slo.ttft_s is not None:
        t = ttft(r)
        if t is None or t > slo.ttft_s:
            return False
    if slo.tpot_s is not None:
        t = tpot(r)
        if t is not None and t > slo.tpot_s:
            return False
    return slo.e2e_s is None or e2e(r) <= slo.e2e_s


# ---------------------------------------------------------------------------- a whole run


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_ok: int
    num_errors: int
    errors_by_code: dict[str, int]
    duration_s: float
    request_throughput: float  # ok requests / s
    output_token_throughput: float  # output tokens of ok requests / s
    input_token_throughput: float  # prompt tokens of ok requests / s
    total_input_tokens: int  # of ok requests
    total_output_tokens: int  # of ok requests
    total_cached_tokens: int  # of ok requests: prompt tokens served from the prefix cache
    slo: SLO | None
    goodput: float | None  # requests meeting the SLO / s
    slo_attainment: float | None  # fraction of requests not interrupted meeting the SLO
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    num_cancelled: int = 0  # the client cancelled them mid-stream on purpose
    num_aborted: int = 0  # the client had the router abort them mid-stream on purpose

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: nested dicts, latencies in seconds, nan written as None."""
        return _nan_to_none(asdict(self))


def _nan_to_none(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, float) and math.isnan(x):
        return None
    return x


def trace_duration(records: Sequence[RequestRecord]) -> float:
    """First send to last response: a duration for a trace whose schedule is unknown."""
    if not records:
        return 0.0
    return max(r.end for r in records) - min(r.start for r in records)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None) -> Summary:
    """The run's counts, throughputs, goodput and latency statistics."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a positive number of seconds, got {duration_s}")
    ok = [r for r in records if r.ok]
    errors = Counter(r.error for r in records if r.error is not None)
    interrupted = Counter(r.interrupted for r in records if r.interrupted and r.error is None)
    judged = [r for r in records if not r.interrupted or r.error is not None]
    n_in = sum(r.num_prompt_tokens for r in ok)
    n_out = sum(r.num_output_tokens for r in ok)
    goodput = attainment = None
    if slo is not None:
        n_good = sum(meets(r, slo) for r in judged)
        goodput = n_good / duration_s
        attainment = n_good / len(judged) if judged else math.nan
    ttfts = [t for t in map(ttft, ok) if t is not None]
    tpots = [t for t in map(tpot, ok) if t is not None]
    gaps = [g for r in ok for g in itls(r)]
    logger.debug("summarized %d records (%d ok) over %.3f s", len(records), len(ok), duration_s)
    return Summary(
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=sum(errors.values()),
        errors_by_code=dict(sorted(errors.items())),
        duration_s=duration_s,
        request_throughput=len(ok) / duration_s,
        output_token_throughput=n_out / duration_s,
        input_token_throughput=n_in / duration_s,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        total_cached_tokens=sum(r.cached_tokens for r in ok),
        slo=slo,
        goodput=goodput,
        slo_attainment=attainment,
        ttft=latency_stats(ttfts),
        tpot=latency_stats(tpots),
        itl=latency_stats(gaps),
        e2e=latency_stats([e2e(r) for r in ok]),
        num_cancelled=interrupted["cancel"],
        num_aborted=interrupted["abort"],
    )
