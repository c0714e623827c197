"""Benchmark output: text tables, the JSON result file, and the CDF / sweep plot.

Tables print latencies in milliseconds and throughputs per second; "-" marks a value with no
data (nan) or no SLO. The JSON file holds latencies in seconds (`Summary.to_dict`), the
settings the run was given, and the raw request records, so any metric can be recomputed.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.bench import metrics
from pdserve.bench.metrics import LatencyStats, Summary, format_slo
from pdserve.bench.trace import RequestRecord, records_from_json, records_to_json

logger = logging.getLogger(__name__)

WIDTH = 56
_LATENCIES = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e"))
_CDF_METRICS = (("TTFT", metrics.ttft), ("ITL", None), ("TPOT", metrics.tpot),
                ("E2E", metrics.e2e))


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None or math.isnan(x) else format(x, fmt)


def _ms(x: float) -> str:
    return _num(x * 1000)


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else format(rate, "g")


def format_table(summary: Summary, title: str = "") -> str:
    """A fixed-width report of one run, like vLLM's `bench serve` output."""
    s = summary
    rows = [
        ("Successful requests", str(s.num_ok)),
        ("Failed requests", str(s.num_errors)),
    ]
    if s.errors_by_code:
        rows.append(("  by code", ", ".join(f"{k}={v}" for k, v in s.errors_by_code.items())))
    if s.num_cancelled or s.num_aborted:  # on purpose (--cancel/--abort-fraction): not failures
        rows += [("Cancelled by the client", str(s.num_cancelled)),
                 ("Aborted through the router", str(s.num_aborted))]
    rows += [
        ("Benchmark duration (s)", _num(s.duration_s)),
        ("Request throughput (req/s)", _num(s.request_throughput)),
        ("Output token throughput (tok/s)", _num(s.output_token_throughput)),
        ("Input token throughput (tok/s)", _num(s.input_token_throughput)),
        ("Total input / output tokens", f"{s.total_input_tokens} / {s.total_output_tokens}"),
        ("Cached prompt tokens", str(s.total_cached_tokens)),
        ("SLO (ms)", format_slo(s.slo) if s.slo else "-"),
        ("Goodput (req/s)", _num(s.goodput)),
        ("SLO attainment (%)", _num(None if s.slo_attainment is None else s.slo_attainment * 100)),
    ]
    head = f" {title} " if title else " Serving Benchmark Result "
    lines = [head.center(WIDTH, "=")]
    lines += [f"{name + ':':<36}{value:>20}" for name, value in rows]
    lines.append(f"{'Latency (ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    lines.append("-" * WIDTH)
    for label, attr in _LATENCIES:
        st: LatencyStats = getattr(s, attr)
        lines.append(f"{label:<16}" + "".join(f"{_ms(v):>10}"
                                             for v in (st.mean, st.p50, st.p90, st.p99)))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


_SWEEP_COLS = (("rate", 8), ("req/s", 9), ("out tok/s", 11), ("TTFT p50", 10),
               ("TTFT p99", 10), ("TPOT p50", 10), ("TPOT p99", 10), ("goodput", 9),
               ("attain %", 9))


def format_sweep(rows: Sequence[tuple[float, Summary]], title: str = "") -> str:
    """One line per offered rate (req/s); latencies in ms."""
    header = "".join(f"{name:>{w}}" for name, w in _SWEEP_COLS)
    lines = [f" {title} ".center(len(header), "=") if title else "=" * len(header), header]
    for rate, s in rows:
        att = None if s.slo_attainment is None else s.slo_attainment * 100
        cells = (_rate(rate), _num(s.request_throughput), _num(s.output_token_throughput),
                 _ms(s.ttft.p50), _ms(s.ttft.p99), _ms(s.tpot.p50), _ms(s.tpot.p99),
                 _num(s.goodput), _num(att, ".1f"))
        lines.append("".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _SWEEP_COLS)))
    if rows and rows[0][1].slo is not None:
        lines.append(f"SLO (ms): {format_slo(rows[0][1].slo)}")
    return "\n".join(lines)


def _jsonable(x: Any) -> Any:
    """Strict JSON: nan -> null, +-inf -> "inf" / "-inf" (e.g. an unlimited request rate)."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def write_json(
    path: str | Path,
    settings: Mapping[str, Any],
    sweep: Sequence[tuple[float, Summary]],
    runs: Sequence[tuple[str, Sequence[RequestRecord]]],
    extras: Sequence[Mapping[str, Any]] | None = None,
) -> None:
    """One JSON file for a benchmark: the settings, then one entry per run.

    Run i pairs `sweep[i]` (offered rate, summary) with `runs[i]` (label, raw records) and
    `extras[i]` (anything else, e.g. the router-histogram comparison):
    {"settings": {...}, "runs": [{"label", "rate", "summary", "extra", "records"}]}.
    Summaries are `Summary.to_dict()` (seconds); records are `records_to_json`. Non-finite
    floats are written as null (nan) or "inf" / "-inf" so the file is strict JSON.
    """
    extras = list(extras) if extras is not None else [{}] * len(runs)
    if not len(sweep) == len(runs) == len(extras):
        raise ValueError(
            f"write_json: {len(sweep)} summaries, {len(runs)} record sets and {len(extras)} "
            f"extras; give one of each per run"
        )
    doc = {
        "settings": settings,
        "runs": [
            {"label": label, "rate": rate, "summary": summary.to_dict(), "extra": extra,
             "records": records_to_json(records)}
            for (rate, summary), (label, records), extra in zip(sweep, runs, extras)
        ],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_jsonable(doc), indent=1, allow_nan=False) + "\n")
    logger.info("wrote %s", path)


def read_records(path: str | Path) -> list[tuple[str, list[RequestRecord]]]:
    """The (label, raw records) of each run in a `write_json` file, ready for `plot`."""
    doc = json.loads(Path(path).read_text())
    return [(run["label"], records_from_json(run["records"])) for run in doc["runs"]]


def _cdf_values(records: Sequence[RequestRecord], name: str) -> list[float]:
    ok = [r for r in records if r.ok]
    if name == "ITL":
        return [g * 1000 for r in ok for g in metrics.itls(r)]
    fn = dict(_CDF_METRICS)[name]
    return [v * 1000 for v in map(fn, ok) if v is not None]


def _plot_cdf(ax: Any, name: str, runs: Sequence[tuple[str, Sequence[RequestRecord]]]) -> None:
    ax.set_title(f"{name} CDF (ok requests)")
    ax.set_xlabel(f"{name} (ms)")
    ax.set_ylabel("fraction")
    ax.grid(True, alpha=0.3)
    lo, hi = math.inf, -math.inf
    for label, records in runs:
        xs = sorted(_cdf_values(records, name))
        if xs:  # the empirical CDF: 0 before the smallest value, then +1/n at each value
            ys = [i / len(xs) for i in range(len(xs) + 1)]
            ax.step([xs[0], *xs], ys, where="post", label=label)
            lo, hi = min(lo, xs[0]), max(hi, xs[-1])
    if lo <= hi and hi - lo < 1e-6 * max(abs(hi), 1.0):  # constant data: widen to +-5%
        pad = max(abs(hi) * 0.05, 0.1)
        ax.set_xlim(lo - pad, hi + pad)
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)
    if ax.get_lines():
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _plot_sweep(axes: Any, sweep: Sequence[tuple[str, Sequence[tuple[float, Summary]]]]) -> None:
    for ax, attr, ylabel in ((axes[0], "goodput", "goodput (req/s within SLO)"),
                             (axes[1], "request_throughput", "throughput (ok req/s)")):
        ax.set_title(f"{ylabel.split(' (')[0].capitalize()} vs offered rate")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        for label, rows in sweep:
            pts = [(rate, getattr(s, attr)) for rate, s in rows
                   if math.isfinite(rate) and getattr(s, attr) is not None]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=label)
        if ax.get_lines():
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data (no SLO or no finite rate)", ha="center", va="center",
                    transform=ax.transAxes)


def plot(
    path: str | Path,
    runs: Sequence[tuple[str, Sequence[RequestRecord]]],
    sweep: Sequence[tuple[str, Sequence[tuple[float, Summary]]]] | None = None,
) -> None:
    """A PNG: CDFs of TTFT, ITL, TPOT and E2E per run label; with `sweep`, goodput and
    request throughput against offered rate per label (rate inf is left out)."""
    # Lazy, and without pyplot: the CLI starts fast and no display backend is ever chosen.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    nrows = 3 if sweep else 2
    fig = Figure(figsize=(11, 4 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, 2, squeeze=False)
    for ax, (name, _) in zip([a for row in axes[:2] for a in row], _CDF_METRICS):
        _plot_cdf(ax, name, runs)
    if sweep:
        _plot_sweep(axes[2], sweep)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), format="png", dpi=100)
    logger.info("wrote %s", path)
