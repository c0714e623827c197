"""Speculative decoding's counts as the router exports them (one series per decode worker, never
summed over router processes) and as `pdserve bench` reads them back: acceptance rate and mean
accepted length over a run, from the difference of two scrapes."""

from __future__ import annotations

import pytest

from pdserve.bench.speculation import (
    SpeculationDelta,
    format_speculation,
    speculation_between,
)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.metrics_merge import merge_expositions, totals_only
from pdserve.router.metrics_text import sample_value

VERIFICATIONS = "pdserve_spec_verifications_total"
DRAFTS = "pdserve_spec_draft_tokens_total"
ACCEPTED = "pdserve_spec_accepted_tokens_total"


def _text(counts: dict[str, tuple[int, int, int]]) -> str:
    """A router's exposition with these decode workers' (verifications, drafts, accepted)."""
    m = RouterMetrics()
    for worker_id, values in counts.items():
        m.speculation.set(worker_id, *values)
    return m.render().decode()


def test_router_exports_each_decode_workers_counts() -> None:
    m = RouterMetrics()
    m.speculation.set("decode-0", 10, 40, 25)
    m.speculation.set("decode-1", 2, 8, 8)
    m.speculation.set("decode-0", 12, 48, 30)  # the next load report: the latest counts
    text = m.render().decode()
    assert f'{DRAFTS}{{worker="decode-0"}} 48.0' in text.splitlines()
    assert "# TYPE pdserve_spec_accepted_tokens_total counter" in text
    assert [sample_value(text, name) for name in (VERIFICATIONS, DRAFTS, ACCEPTED)] == [
        14, 56, 38]
    assert sample_value(text, ACCEPTED, {"worker": "decode-1"}) == 8
    m.remove_worker("decode-1")  # a worker that left: its series go
    text = m.render().decode()
    assert sample_value(text, ACCEPTED) == 30 and 'worker="decode-1"' not in text


def test_router_processes_show_worker_counts_once() -> None:
    # every router process polls the same workers: the service shows one copy, not a sum
    own = _text({"decode-0": (10, 40, 25)})
    child = RouterMetrics()
    child.speculation.set("decode-0", 10, 40, 25)
    child.count_request("ok")
    ended = totals_only(child.render().decode())  # a router process that ended
    assert DRAFTS not in ended and 'pdserve_requests_total{status="ok"} 1.0' in ended
    merged = merge_expositions(own, [child.render().decode(), ended])
    assert [sample_value(merged, name) for name in (VERIFICATIONS, DRAFTS, ACCEPTED)] == [
        10, 40, 25]
    assert sample_value(merged, "pdserve_requests_total", {"status": "ok"}) == 2  # summed


def test_bench_reads_rate_and_length_from_counter_deltas() -> None:
    before = _text({"decode-0": (100, 400, 250), "decode-1": (5, 20, 10)})
    after = _text({"decode-0": (160, 640, 400), "decode-1": (65, 260, 160)})
    delta = speculation_between(before, after)
    assert delta == SpeculationDelta(num_verifications=120, num_draft_tokens=480,
                                     num_accepted_tokens=300)
    assert delta.acceptance_rate == pytest.approx(300 / 480)
    assert delta.mean_accepted_length == pytest.approx((300 + 120) / 120)  # 3.5 per step
    assert delta.to_dict()["mean_accepted_length"] == pytest.approx(3.5)
    assert format_speculation(delta) == (
        "speculative decoding: acceptance rate 62.5% (300 of 480 draft tokens), mean accepted "
        "length 3.50 tokens per verification (120 verifications)")


def test_bench_counts_a_restarted_or_new_worker_from_zero() -> None:
    before = _text({"decode-0": (100, 400, 250), "decode-1": (50, 200, 100)})
    # decode-0 restarted mid-run (its counters went down), decode-2 joined, decode-1 left
    after = _text({"decode-0": (10, 40, 20), "decode-2": (10, 40, 40)})
    delta = speculation_between(before, after)
    assert (delta.num_verifications, delta.num_draft_tokens, delta.num_accepted_tokens) == (
        20, 80, 60)


def test_bench_reports_nothing_without_speculation() -> None:
    idle = _text({"decode-0": (7, 28, 14)})
    assert speculation_between(idle, idle) is None  # counters did not move
    plain = RouterMetrics().render().decode()  # no decode worker reported yet
    assert speculation_between(plain, plain) is None
    assert speculation_between(None, idle) is None  # /metrics unreachable
    assert speculation_between(idle, None) is None
