"""Benchmark metrics on a hand-built trace; every expected value is worked out in a comment."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pdserve.bench.metrics import (
    SLO,
    format_slo,
    itls,
    meets,
    parse_slo,
    percentile,
    summarize,
    tpot,
    trace_duration,
    ttft,
)
from pdserve.bench.metrics import e2e as e2e_of
from pdserve.bench.trace import RequestRecord, records_from_json, records_to_json

approx = pytest.approx

# A: start 0.0; messages at 0.5 (1 token), 0.6 (1), 1.0 (2); a token-less final message at 1.1.
A = RequestRecord("a", 0.0, 1.1, (0.5, 0.6, 1.0), (1, 1, 2), num_prompt_tokens=10)
# B: one token only: start 1.0, token at 1.2, end 1.25.
B = RequestRecord("b", 1.0, 1.25, (1.2,), (1,), num_prompt_tokens=20)
# C: first message brings 3 tokens: start 2.0; 2.3 (3), 2.4 (1), 2.9 (2); end 3.0; 16 cached.
C = RequestRecord("c", 2.0, 3.0, (2.3, 2.4, 2.9), (3, 1, 2), num_prompt_tokens=30,
                  cached_tokens=16, session_id="s")
# D: failed after one token: start 3.0, token at 3.4, UNAVAILABLE at 3.5.
D = RequestRecord("d", 3.0, 3.5, (3.4,), (1,), num_prompt_tokens=40, error="UNAVAILABLE")
TRACE = [A, B, C, D]
DURATION = 5.0


def test_record_properties():
    assert (A.num_output_tokens, B.num_output_tokens, C.num_output_tokens) == (4, 1, 6)
    assert A.first_token_time == 0.5 and A.last_token_time == 1.0
    assert A.ok and not D.ok
    empty = RequestRecord("e", 0.0, 1.0, (), (), 5, error="DEADLINE_EXCEEDED")
    assert empty.first_token_time is None and empty.num_output_tokens == 0


def test_record_validation():
    with pytest.raises(ValueError, match="chunk_times"):
        RequestRecord("x", 0.0, 1.0, (0.5, 0.6), (1,), 3)
    with pytest.raises(ValueError, match=">= 1"):
        RequestRecord("x", 0.0, 1.0, (0.5,), (0,), 3)
    with pytest.raises(ValueError, match="token counts"):
        RequestRecord("x", 0.0, 1.0, (), (), -1)


def test_ttft_e2e_per_request():
    # A: 0.5 - 0.0; B: 1.2 - 1.0; C: 2.3 - 2.0; D (failed) still has one: 3.4 - 3.0.
    assert [ttft(r) for r in TRACE] == approx([0.5, 0.2, 0.3, 0.4])
    # A: 1.1 - 0.0 (the token-less final message counts); B: 0.25; C: 1.0; D: 0.5.
    assert [e2e_of(r) for r in TRACE] == approx([1.1, 0.25, 1.0, 0.5])
    assert ttft(RequestRecord("e", 0.0, 1.0, (), (), 5)) is None


def test_tpot_per_request():
    # A: (1.0 - 0.5) / (4 - 1) = 1/6; B: one token -> None; C: (2.9 - 2.3) / (6 - 1) = 0.12.
    assert tpot(A) == approx(1 / 6)
    assert tpot(B) is None
    assert tpot(C) == approx(0.12)


def test_itls_per_request():
    # A: 0.6 - 0.5 = 0.1 for 1 token; then 0.4 over 2 tokens -> 0.2, 0.2.
    assert itls(A) == approx([0.1, 0.2, 0.2])
    assert itls(B) == []
    # C: first message's 3 tokens -> 2 zeros; 0.1 for 1 token; 0.5 over 2 -> 0.25, 0.25.
    assert itls(C) == approx([0.0, 0.0, 0.1, 0.25, 0.25])


@pytest.mark.parametrize("r", [A, B, C])
def test_itls_count_and_sum_match_tpot(r):
    gaps = itls(r)
    assert len(gaps) == r.num_output_tokens - 1
    assert sum(gaps) == approx(r.last_token_time - r.first_token_time)
    if gaps:
        assert sum(gaps) / len(gaps) == approx(tpot(r))


def test_percentile_by_hand():
    xs = [0.5, 0.2, 0.3]  # sorted 0.2, 0.3, 0.5; rank = (3 - 1) * q / 100
    assert percentile(xs, 50) == approx(0.3)  # rank 1
    assert percentile(xs, 90) == approx(0.46)  # rank 1.8: 0.3 + 0.8 * 0.2
    assert percentile(xs, 0) == approx(0.2)
    assert percentile(xs, 100) == approx(0.5)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 10, 101):
        xs = rng.exponential(1.0, n).tolist()
        for q in (0, 1, 10, 25, 50, 66.6, 90, 99, 99.9, 100):
            assert percentile(xs, q) == approx(float(np.percentile(xs, q)), rel=1e-12)


@pytest.mark.parametrize("q", [-1, 100.5, math.nan])
def test_percentile_rejects_bad_q(q):
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], q)


def test_summarize_counts_and_throughput():
    s = summarize(TRACE, DURATION, None)
    assert (s.num_requests, s.num_ok, s.num_errors) == (4, 3, 1)
    assert s.errors_by_code == {"UNAVAILABLE": 1}
    assert s.request_throughput == approx(3 / 5)  # ok requests A, B, C over 5 s
    assert s.output_token_throughput == approx(11 / 5)  # 4 + 1 + 6 tokens, D excluded
    assert s.input_token_throughput == approx(60 / 5)  # 10 + 20 + 30 prompt tokens
    assert (s.total_input_tokens, s.total_output_tokens, s.total_cached_tokens) == (60, 11, 16)
    assert s.goodput is None and s.slo_attainment is None and s.slo is None


def test_summarize_latency_stats():
    s = summarize(TRACE, DURATION, None)
    # TTFT of ok requests: 0.5, 0.2, 0.3 (D's 0.4 excluded). Sorted 0.2, 0.3, 0.5.
    assert s.ttft.mean == approx(1.0 / 3)
    assert (s.ttft.p50, s.ttft.p90, s.ttft.p99) == approx((0.3, 0.46, 0.496))  # 0.3+.98*.2
    # TPOT: A 1/6, C 0.12 (B has none). p-th at rank p/100: 0.12 + q * (1/6 - 0.12).
    d = 1 / 6 - 0.12
    assert s.tpot.mean == approx((1 / 6 + 0.12) / 2)
    assert (s.tpot.p50, s.tpot.p90, s.tpot.p99) == approx((0.12 + .5 * d, 0.12 + .9 * d,
                                                           0.12 + .99 * d))
    # ITL over all 8 gaps: 0, 0, 0.1, 0.1, 0.2, 0.2, 0.25, 0.25; sum 1.1.
    # p50 at rank 3.5: (0.1 + 0.2) / 2; p90 at rank 6.3 and p99 at 6.93: both 0.25.
    assert s.itl.mean == approx(1.1 / 8)
    assert (s.itl.p50, s.itl.p90, s.itl.p99) == approx((0.15, 0.25, 0.25))
    # E2E of ok requests: 1.1, 0.25, 1.0 -> sorted 0.25, 1.0, 1.1; mean 2.35 / 3.
    assert s.e2e.mean == approx(2.35 / 3)
    assert (s.e2e.p50, s.e2e.p90, s.e2e.p99) == approx((1.0, 1.08, 1.098))


@pytest.mark.parametrize(
    ("slo_text", "meeting"),
    [
        # TTFT <= 0.4: A (0.5) misses; B (0.2) and C (0.3) meet; D failed.
        # TPOT <= 0.15: B has no TPOT (meets), C 0.12 meets.
        ("ttft=400,tpot=150", ["b", "c"]),
        # TPOT alone: A 1/6 > 0.15 misses, B none, C 0.12.
        ("tpot=150", ["b", "c"]),
        # E2E <= 1.05: A 1.1 misses, B 0.25, C 1.0 meet.
        ("e2e=1050", ["b", "c"]),
        # TTFT <= 0.6: all ok requests meet; D never does.
        ("ttft=600", ["a", "b", "c"]),
        # TPOT <= 0.1: only B (no TPOT) meets.
        ("tpot=100", ["b"]),
    ],
)
def test_goodput_and_attainment(slo_text, meeting):
    slo = parse_slo(slo_text)
    assert [r.request_id for r in TRACE if meets(r, slo)] == meeting
    s = summarize(TRACE, DURATION, slo)
    assert s.goodput == approx(len(meeting) / DURATION)
    assert s.slo_attainment == approx(len(meeting) / 4)  # over all 4, the failure a miss
    assert s.slo == slo


def test_failed_never_meets_and_no_token_misses_ttft():
    assert not meets(D, SLO(ttft_s=100.0))
    no_tokens = RequestRecord("e", 0.0, 0.1, (), (), 5)
    assert not meets(no_tokens, SLO(ttft_s=100.0))
    assert meets(no_tokens, SLO(e2e_s=1.0))


def test_parse_slo():
    assert parse_slo("ttft=500,tpot=50") == SLO(ttft_s=0.5, tpot_s=0.05)
    assert parse_slo(" ttft:250  e2e:2000 ") == SLO(ttft_s=0.25, e2e_s=2.0)
    assert parse_slo("E2E=1500.5") == SLO(e2e_s=1.5005)
    assert format_slo(parse_slo("ttft=500,tpot=50,e2e=3000")) == "ttft=500,tpot=50,e2e=3000"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("itl=50", "itl"),
        ("ttft=fast", "fast"),
        ("ttft=-5", "-5"),
        ("ttft=0", "0"),
        ("tpot=inf", "inf"),
        ("ttft", "ttft"),
        ("ttft=1,ttft=2", "twice"),
        ("", "empty"),
    ],
)
def test_parse_slo_errors_name_the_problem(text, named):
    with pytest.raises(ValueError, match=named):
        parse_slo(text)


def test_slo_validation():
    with pytest.raises(ValueError, match="at least one"):
        SLO()
    with pytest.raises(ValueError, match="positive"):
        SLO(ttft_s=-1.0)


def test_summary_to_dict_is_strict_json():
    empty = summarize([], 1.0, SLO(ttft_s=1.0))
    assert math.isnan(empty.ttft.p50) and math.isnan(empty.slo_attainment)
    d = empty.to_dict()
    assert d["ttft"]["p50"] is None and d["slo_attainment"] is None
    json.dumps(d, allow_nan=False)
    full = summarize(TRACE, DURATION, parse_slo("ttft=400")).to_dict()
    assert full["ttft"]["p50"] == approx(0.3) and full["slo"] == {
        "ttft_s": 0.4, "tpot_s": None, "e2e_s": None}
    assert json.loads(json.dumps(full, allow_nan=False)) == full


def test_summarize_rejects_bad_duration():
    with pytest.raises(ValueError, match="duration_s"):
        summarize(TRACE, 0.0, None)


def test_trace_duration():
    assert trace_duration(TRACE) == approx(3.5)  # first start 0.0, last end 3.5 (D)
    assert trace_duration([]) == 0.0


def test_records_json_round_trip():
    items = records_to_json(TRACE)
    assert json.loads(json.dumps(items)) == items
    assert records_from_json(json.loads(json.dumps(items))) == TRACE
    with pytest.raises(ValueError, match="unknown keys"):
        records_from_json([{**items[0], "extra": 1}])
    with pytest.raises(ValueError, match="record 0"):
        records_from_json([{"request_id": "x"}])
