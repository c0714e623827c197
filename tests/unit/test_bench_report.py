"""Benchmark reports: the table shows the summary's numbers, JSON is strict, the PNG is real."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from pdserve.bench.metrics import SLO, LatencyStats, Summary, summarize
from pdserve.bench.report import format_sweep, format_table, plot, read_records, write_json
from pdserve.bench.trace import RequestRecord

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SLO_500_50 = SLO(ttft_s=0.5, tpot_s=0.05)


def _summary(slo: SLO | None = SLO_500_50, goodput: float | None = 1.25,
             attainment: float | None = 0.875) -> Summary:
    return Summary(
        num_requests=9, num_ok=7, num_errors=2, errors_by_code={"UNAVAILABLE": 2},
        duration_s=4.0, request_throughput=1.75, output_token_throughput=321.5,
        input_token_throughput=876.25, total_input_tokens=3505, total_output_tokens=1286,
        total_cached_tokens=64, slo=slo, goodput=goodput, slo_attainment=attainment,
        ttft=LatencyStats(0.1234, 0.1, 0.2, 0.3),
        tpot=LatencyStats(0.0125, 0.011, 0.019, math.nan),
        itl=LatencyStats(0.012, 0.01, 0.02, 0.04),
        e2e=LatencyStats(1.5, 1.25, 2.0, 2.5),
    )


def _records(shift: float = 0.0) -> list[RequestRecord]:
    out = []
    for i in range(20):
        s = i * 0.1 + shift
        times = tuple(s + 0.2 + 0.03 * j + 0.001 * i for j in range(1, 6))
        out.append(RequestRecord(f"r{i}", s, times[-1] + 0.01, times, (2, 1, 1, 1, 1), 50))
    out.append(RequestRecord("bad", 0.0, 0.5, (), (), 50, error="UNAVAILABLE"))
    return out


def test_table_shows_the_numbers():
    text = format_table(_summary(), title="run 1")
    assert "run 1" in text
    for line_start, value in [("Successful requests", "7"), ("Failed requests", "2"),
                              ("Benchmark duration", "4.00"), ("Request throughput", "1.75"),
                              ("Output token throughput", "321.50"),
                              ("Input token throughput", "876.25"), ("Goodput", "1.25"),
                              ("SLO attainment", "87.50"), ("SLO (ms)", "ttft=500,tpot=50")]:
        (line,) = [ln for ln in text.splitlines() if ln.startswith(line_start)]
        assert line.split()[-1] == value, line
    assert "UNAVAILABLE=2" in text
    rows = {ln.split()[0]: ln.split()[1:] for ln in text.splitlines()
            if ln.split() and ln.split()[0] in ("TTFT", "TPOT", "ITL", "E2E")}
    assert rows["TTFT"] == ["123.40", "100.00", "200.00", "300.00"]  # seconds -> ms
    assert rows["TPOT"] == ["12.50", "11.00", "19.00", "-"]  # nan -> "-"
    assert rows["ITL"] == ["12.00", "10.00", "20.00", "40.00"]
    assert rows["E2E"] == ["1500.00", "1250.00", "2000.00", "2500.00"]


def test_table_without_slo():
    text = format_table(_summary(slo=None, goodput=None, attainment=None))
    assert "Serving Benchmark Result" in text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("Goodput")]
    assert line.split()[-1] == "-"


def test_sweep_one_line_per_rate():
    text = format_sweep([(1.0, _summary()), (math.inf, _summary())], title="sweep")
    lines = text.splitlines()
    assert "sweep" in lines[0] and lines[1].split()[0] == "rate"
    first = lines[2].split()
    # rate, req/s, out tok/s, TTFT p50/p99, TPOT p50/p99 (ms), goodput, attainment %
    assert first == ["1", "1.75", "321.50", "100.00", "300.00", "11.00", "-", "1.25", "87.5"]
    assert lines[3].split()[0] == "inf"
    assert lines[-1] == "SLO (ms): ttft=500,tpot=50"


def test_write_json_is_strict_and_round_trips(tmp_path):
    recs = _records()
    summary = summarize(recs, 3.0, SLO(ttft_s=0.25))
    path = tmp_path / "out" / "bench.json"
    write_json(path, {"rate": math.inf, "workload": "grid"}, [(math.inf, summary)],
               [("all at once", recs)], [{"router": {"ttft_p50_s": 0.2}}])

    def no_constants(name):
        raise AssertionError(f"non-strict JSON constant {name}")

    doc = json.loads(path.read_text(), parse_constant=no_constants)
    assert doc["settings"] == {"rate": "inf", "workload": "grid"}
    (run,) = doc["runs"]
    assert run["label"] == "all at once" and run["rate"] == "inf"
    assert run["summary"]["num_errors"] == 1 and run["extra"] == {"router": {"ttft_p50_s": 0.2}}
    assert run["summary"]["ttft"]["p50"] == pytest.approx(summary.ttft.p50)
    assert read_records(path) == [("all at once", recs)]
    with pytest.raises(ValueError, match="one of each"):
        write_json(path, {}, [(1.0, summary)], [])


def _check_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 20_000  # four (or six) drawn panels, not an empty canvas


def test_plot_cdfs(tmp_path):
    path = tmp_path / "cdf.png"
    plot(path, [("pd", _records()), ("colocated", _records(0.05))])
    _check_png(path)


def test_plot_with_sweep(tmp_path):
    recs = _records()
    sweep = [(r, summarize(recs, 2.0 + 2.0 / r, SLO(ttft_s=0.22))) for r in (1.0, 2.0, math.inf)]
    path = tmp_path / "sub" / "sweep.png"
    plot(path, [("pd", recs)], sweep=[("pd", sweep), ("colocated", sweep[:2])])
    _check_png(path)


def test_plot_without_data(tmp_path):
    path = tmp_path / "empty.png"
    failed = [RequestRecord("x", 0.0, 1.0, (), (), 3, error="INTERNAL")]
    no_slo = [(1.0, summarize(failed, 1.0, None))]
    plot(path, [("failed", failed)], sweep=[("x", no_slo)])
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_library_imports_neither_matplotlib_nor_torch():
    code = ("import sys; import pdserve.bench.report, pdserve.bench.workloads, "
            "pdserve.bench.arrivals; "
            "print(sorted(m for m in ('matplotlib', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
