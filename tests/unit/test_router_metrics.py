"""RouterMetrics: exposition contents, its HTTP endpoint, and quantiles read back from text."""

from __future__ import annotations

import math
import urllib.error
import urllib.request

import pytest

from pdserve.router.metrics import LATENCY_BUCKETS, REQUEST_STATUSES, RouterMetrics
from pdserve.router.metrics_text import histogram_buckets, histogram_quantile


def _sample(text: bytes, line_prefix: str) -> float:
    """Value of the one exposition line starting with `line_prefix` + ' '."""
    for line in text.decode().splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_prefix} not in exposition")


def test_latency_observations_show_up_with_counts_and_sums():
    m = RouterMetrics()
    m.observe_ttft(0.2)
    m.observe_ttft(0.4)
    m.observe_e2e(3.0)
    m.observe_transfer(4096, 0.01)
    m.observe_transfer(1024, 0.03)
    text = m.render()
    assert _sample(text, "pdserve_time_to_first_token_seconds_count") == 2
    assert _sample(text, "pdserve_time_to_first_token_seconds_sum") == pytest.approx(0.6)
    assert _sample(text, 'pdserve_time_to_first_token_seconds_bucket{le="0.2"}') == 1
    assert _sample(text, 'pdserve_time_to_first_token_seconds_bucket{le="0.001"}') == 0
    assert _sample(text, 'pdserve_time_to_first_token_seconds_bucket{le="100.0"}') == 2
    assert _sample(text, "pdserve_e2e_request_latency_seconds_sum") == 3.0
    assert _sample(text, "pdserve_kv_transfer_latency_seconds_count") == 2
    assert _sample(text, "pdserve_kv_transfer_bytes_total") == 5120


def test_itl_spreads_a_multi_token_gap_per_token():
    m = RouterMetrics()
    m.observe_itl(0.02)
    m.observe_itl(0.09, count=3)  # three tokens after a 90 ms gap: three 30 ms gaps
    text = m.render()
    assert _sample(text, "pdserve_inter_token_latency_seconds_count") == 4
    assert _sample(text, "pdserve_inter_token_latency_seconds_sum") == pytest.approx(0.11)
    assert _sample(text, 'pdserve_inter_token_latency_seconds_bucket{le="0.02"}') == 1
    assert _sample(text, 'pdserve_inter_token_latency_seconds_bucket{le="0.0316"}') == 4
    assert _sample(text, 'pdserve_inter_token_latency_seconds_bucket{le="0.000501"}') == 0
    with pytest.raises(ValueError, match="count"):
        m.observe_itl(0.1, count=0)
    with pytest.raises(ValueError, match="seconds"):
        m.observe_ttft(-1.0)


def test_counters_and_prefix_hit_rate():
    m = RouterMetrics()
    text = m.render()
    for status in REQUEST_STATUSES:  # exported at zero before the first request
        assert _sample(text, f'pdserve_requests_total{{status="{status}"}}') == 0
    m.count_request("ok")
    m.count_request("ok")
    m.count_request("overloaded")
    m.count_tokens(prompt=100, generated=20, cached=64)
    m.count_tokens(prompt=50, generated=5, cached=0)
    with pytest.raises(ValueError, match="status"):
        m.count_request("weird")
    with pytest.raises(ValueError, match="cached"):
        m.count_tokens(prompt=1, generated=1, cached=2)
    text = m.render()
    assert _sample(text, 'pdserve_requests_total{status="ok"}') == 2
    assert _sample(text, 'pdserve_requests_total{status="overloaded"}') == 1
    assert _sample(text, 'pdserve_requests_total{status="error"}') == 0
    assert _sample(text, "pdserve_prompt_tokens_total") == 150
    assert _sample(text, "pdserve_generation_tokens_total") == 25
    queries = _sample(text, "pdserve_prefix_cache_queries_tokens_total")
    hits = _sample(text, "pdserve_prefix_cache_hit_tokens_total")
    assert (queries, hits) == (150, 64)


def test_gauges_workers_and_removal():
    m = RouterMetrics()
    m.set_queue(depth=3, inflight=7)
    m.set_redis_up(True)
    m.set_worker("d0", "decode", True, num_blocks=200, num_free_blocks=50)
    m.set_worker("p0", "prefill", False, num_blocks=0, num_free_blocks=0, step_token_budget=96)
    text = m.render()
    assert _sample(text, "pdserve_queue_depth") == 3
    assert _sample(text, "pdserve_requests_inflight") == 7
    assert _sample(text, "pdserve_redis_up") == 1
    assert _sample(text, 'pdserve_worker_up{role="decode",worker="d0"}') == 1
    assert _sample(text, 'pdserve_worker_up{role="prefill",worker="p0"}') == 0
    assert _sample(text, 'pdserve_kv_blocks_total{worker="d0"}') == 200
    assert _sample(text, 'pdserve_kv_blocks_free{worker="d0"}') == 50
    assert _sample(text, 'pdserve_step_token_budget{worker="p0"}') == 96
    assert _sample(text, 'pdserve_kv_usage_ratio{worker="d0"}') == 0.75
    assert _sample(text, 'pdserve_kv_usage_ratio{worker="p0"}') == 0.0  # no pool: no divide
    m.set_redis_up(False)
    m.remove_worker("d0")
    m.remove_worker("never-seen")  # harmless
    text = m.render()
    assert b'worker="d0"' not in text
    assert b'worker="p0"' in text
    assert _sample(text, "pdserve_redis_up") == 0


def test_two_instances_do_not_clash():
    a, b = RouterMetrics(), RouterMetrics()
    a.count_request("ok")
    a.observe_ttft(1.0)
    text_b = b.render()
    assert _sample(text_b, 'pdserve_requests_total{status="ok"}') == 0
    assert _sample(text_b, "pdserve_time_to_first_token_seconds_count") == 0
    assert _sample(a.render(), 'pdserve_requests_total{status="ok"}') == 1


def test_http_endpoint_serves_on_loopback_and_stops():
    m = RouterMetrics()
    m.count_request("ok")
    port = m.start_http("127.0.0.1", 0)
    try:
        assert port > 0
        with pytest.raises(RuntimeError, match="already started"):
            m.start_http("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = resp.read()
        assert resp.status == 200
        assert _sample(body, 'pdserve_requests_total{status="ok"}') == 1
    finally:
        m.stop_http()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)
    m.stop_http()  # idempotent
    port2 = m.start_http("127.0.0.1", 0)  # restartable
    m.stop_http()
    assert port2 > 0


HAND_BUILT = """\
# HELP lat_seconds A hand-built histogram.
# TYPE lat_seconds histogram
lat_seconds_bucket{le="0.1"} 10.0
lat_seconds_bucket{le="0.2"} 30.0
lat_seconds_bucket{le="0.5"} 80.0
lat_seconds_bucket{le="1.0"} 100.0
lat_seconds_bucket{le="+Inf"} 100.0
lat_seconds_count 100.0
lat_seconds_sum 40.0
"""


def test_histogram_quantile_hand_built():
    # median: rank 50 lands in (0.2, 0.5] holding 50 obs, 20 of them below rank
    #   -> 0.2 + 0.3 * 20/50 = 0.32
    assert histogram_quantile(HAND_BUILT, "lat_seconds", 0.5) == pytest.approx(0.32)
    # p5: rank 5 in the first bucket, lower bound 0 -> 0.1 * 5/10 = 0.05
    assert histogram_quantile(HAND_BUILT, "lat_seconds", 0.05) == pytest.approx(0.05)
    # p99: rank 99 in (0.5, 1.0] holding 20, 19 below rank -> 0.5 + 0.5 * 19/20 = 0.975
    assert histogram_quantile(HAND_BUILT.encode(), "lat_seconds_bucket", 0.99) == pytest.approx(
        0.975
    )
    assert histogram_quantile(HAND_BUILT, "lat_seconds", 1.0) == pytest.approx(1.0)
    assert histogram_buckets(HAND_BUILT, "lat_seconds")[-1] == (math.inf, 100.0)
    with pytest.raises(ValueError, match="q must be"):
        histogram_quantile(HAND_BUILT, "lat_seconds", 1.5)
    with pytest.raises(ValueError, match="no histogram buckets"):
        histogram_quantile(HAND_BUILT, "missing_seconds", 0.5)


def test_histogram_quantile_in_inf_bucket_returns_largest_finite_bound():
    text = HAND_BUILT.replace('le="+Inf"} 100.0', 'le="+Inf"} 200.0')
    assert histogram_quantile(text, "lat_seconds", 0.9) == 1.0


def test_histogram_quantile_sums_series_and_filters_labels():
    text = (
        "# TYPE x histogram\n"
        'x_bucket{w="a",le="1.0"} 10.0\nx_bucket{w="a",le="2.0"} 10.0\n'
        'x_bucket{w="a",le="+Inf"} 10.0\n'
        'x_bucket{w="b",le="1.0"} 0.0\nx_bucket{w="b",le="2.0"} 10.0\n'
        'x_bucket{w="b",le="+Inf"} 10.0\n'
    )
    # summed per le: 1.0 -> 10, 2.0 -> 20, +Inf -> 20
    # p75: rank 15 in (1, 2] holding 10, 5 of them below rank -> 1 + 1 * 5/10 = 1.5
    assert histogram_quantile(text, "x", 0.75) == pytest.approx(1.5)
    # a alone: rank 5 in (0, 1] holding 10 -> 0.5; b alone: rank 5 in (1, 2] -> 1.5
    assert histogram_quantile(text, "x", 0.5, labels={"w": "a"}) == pytest.approx(0.5)
    assert histogram_quantile(text, "x", 0.5, labels={"w": "b"}) == pytest.approx(1.5)


def test_histogram_quantile_of_router_histogram_matches_hand_answer():
    m = RouterMetrics()
    assert math.isnan(histogram_quantile(m.render(), "pdserve_time_to_first_token_seconds", 0.5))
    # 100 observations uniformly placed at 0.005, 0.015, ..., 0.995 s
    for i in range(100):
        m.observe_ttft(0.005 + 0.01 * i)
    assert {0.447, 0.501, 0.891, 1.0} <= set(LATENCY_BUCKETS)
    text = m.render()
    # median: rank 50; 45 obs <= 0.447 (i <= 44), 50 obs <= 0.501 (i <= 49)
    #   -> 0.447 + (0.501 - 0.447) * (50 - 45) / (50 - 45) = 0.501
    assert histogram_quantile(text, "pdserve_time_to_first_token_seconds", 0.5) == pytest.approx(
        0.501
    )
    # p90: rank 90; 89 obs <= 0.891 (i <= 88), 100 obs <= 1.0
    #   -> 0.891 + (1.0 - 0.891) * (90 - 89) / (100 - 89) = 0.9009...
    assert histogram_quantile(text, "pdserve_time_to_first_token_seconds", 0.9) == pytest.approx(
        0.891 + 0.109 * 1 / 11
    )
