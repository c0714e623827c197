"""Request traces for the simulator: (arrival_s, input_tokens, output_tokens), seeded.

- `steady_trace`: Poisson arrivals at one rate (`pdserve.bench.arrivals.poisson_times`).
- `bursty_trace`: the same, with the rate multiplied by `spike_factor` for `spike_len_s`
  seconds from `spike_start_s`. Each segment is its own Poisson process (memoryless, so
  starting one at its segment's start is exact); the first segment uses `seed` itself, so a
  bursty trace and a steady one of the same seed agree before the spike.
- `load_trace`: a JSON file, either a list of [arrival_s, input_tokens, output_tokens] (or of
  objects with those keys), or a `pdserve bench --json` result, whose first run's requests are
  replayed (send times shifted to start at 0, lengths as measured).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, NamedTuple

from pdserve.bench.arrivals import poisson_times
from pdserve.bench.trace import records_from_json

logger = logging.getLogger(__name__)


class TraceRequest(NamedTuple):
    arrival_s: float
    input_tokens: int
    output_tokens: int


def _poisson_segment(rate: float, start_s: float, end_s: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process of `rate` on [start_s, end_s)."""
    length = end_s - start_s
    if rate <= 0 or length <= 0:
        return []
    n = math.ceil(rate * length + 6 * math.sqrt(rate * length) + 10)  # enough, w.h.p.
    while True:
        times = poisson_times(n, rate, seed=seed)
        if times[-1] >= length:
            return [start_s + t for t in times if t < length]
        n *= 2


def _check_lengths(input_tokens: int, output_tokens: int) -> None:
    if input_tokens < 1 or output_tokens < 1:
        raise ValueError(f"input_tokens and output_tokens must be >= 1, got "
                         f"{input_tokens} and {output_tokens}")


def steady_trace(
    rate: float, duration_s: float, input_tokens: int, output_tokens: int, seed: int = 0
) -> list[TraceRequest]:
    """Poisson arrivals at `rate` req/s over [0, duration_s), every request the same size."""
    if not (math.isfinite(rate) and rate > 0) or not duration_s > 0:
        raise ValueError(f"need rate > 0 and duration_s > 0, got {rate} and {duration_s}")
    _check_lengths(input_tokens, output_tokens)
    times = _poisson_segment(rate, 0.0, duration_s, seed)
    return [TraceRequest(t, input_tokens, output_tokens) for t in times]


def bursty_trace(
    base_rate: float, duration_s: float, input_tokens: int, output_tokens: int,
    spike_factor: float = 4.0, spike_start_s: float | None = None,
    spike_len_s: float | None = None, seed: int = 0,
) -> list[TraceRequest]:
    """`base_rate`, then `base_rate * spike_factor` on [spike_start_s, + spike_len_s), then
    `base_rate` again. Defaults: the spike starts at a third of the run and lasts a sixth."""
    if not (math.isfinite(base_rate) and base_rate > 0) or not duration_s > 0:
        raise ValueError(f"need base_rate > 0 and duration_s > 0, got {base_rate} and "
                         f"{duration_s}")
    if not spike_factor > 0:
        raise ValueError(f"spike_factor must be > 0, got {spike_factor}")
    _check_lengths(input_tokens, output_tokens)
    start = duration_s / 3 if spike_start_s is None else spike_start_s
    length = duration_s / 6 if spike_len_s is None else spike_len_s
    if start < 0 or length < 0:
        raise ValueError(f"spike_start_s and spike_len_s must be >= 0, got {start}, {length}")
    end = min(start + length, duration_s)
    times = (_poisson_segment(base_rate, 0.0, min(start, duration_s), seed)
             + _poisson_segment(base_rate * spike_factor, start, end, seed + 1_000_003)
             + _poisson_segment(base_rate, end, duration_s, seed + 2_000_006))
    return [TraceRequest(t, input_tokens, output_tokens) for t in times]


def _item(i: int, item: Any) -> TraceRequest:
    if isinstance(item, dict):
        keys = {"arrival_s", "input_tokens", "output_tokens"}
        if set(item) != keys:
            raise ValueError(f"trace item {i}: expected keys {sorted(keys)}, got {sorted(item)}")
        item = [item["arrival_s"], item["input_tokens"], item["output_tokens"]]
    if not isinstance(item, (list, tuple)) or len(item) != 3:
        raise ValueError(f"trace item {i}: expected [arrival_s, input_tokens, output_tokens], "
                         f"got {item!r}")
    return TraceRequest(float(item[0]), int(item[1]), int(item[2]))


def load_trace(path: str | Path) -> list[TraceRequest]:
    """A trace from JSON (see the module docstring for the accepted forms)."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if isinstance(doc, dict) and "runs" in doc:
        if not doc["runs"]:
            raise ValueError(f"{path}: a bench result without runs")
        records = records_from_json(doc["runs"][0]["records"])
        t0 = min((r.start for r in records), default=0.0)
        trace = [TraceRequest(r.start - t0, r.num_prompt_tokens, max(r.num_output_tokens, 1))
                 for r in records]
    elif isinstance(doc, list):
        trace = [_item(i, item) for i, item in enumerate(doc)]
    else:
        raise ValueError(f"{path}: expected a list of requests or a pdserve bench result")
    logger.info("loaded %d requests from %s", len(trace), path)
    return sorted(trace, key=lambda r: r.arrival_s)


def save_trace(path: str | Path, trace: list[TraceRequest]) -> None:
    """Write `trace` as a JSON list of [arrival_s, input_tokens, output_tokens]."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps([list(r) for r in trace]) + "\n")
