"""Several router processes' metrics as one service's: what is summed, what is the service's own."""

from __future__ import annotations

from pdserve.router.metrics import RouterMetrics
from pdserve.router.metrics_merge import merge_expositions, totals_only
from pdserve.router.metrics_text import histogram_buckets, sample_value


def _router(ok: int, itl: list[float], queued: int, inflight: int, free_blocks: int,
            redis_up: bool) -> RouterMetrics:
    m = RouterMetrics()
    for _ in range(ok):
        m.count_request("ok")
    for gap in itl:
        m.observe_itl(gap)
    m.count_tokens(prompt=10 * ok, generated=5 * ok, cached=ok)
    m.set_queue(queued, inflight)
    m.set_worker("decode-0", "decode", True, 100, free_blocks)
    m.set_redis_up(redis_up)
    return m


def test_counters_histograms_and_held_work_add_up_worker_gauges_stay_the_parents():
    parent = _router(ok=3, itl=[0.01, 0.5], queued=1, inflight=4, free_blocks=60, redis_up=True)
    child = _router(ok=5, itl=[0.01], queued=2, inflight=7, free_blocks=10, redis_up=False)
    child.count_request("unavailable")
    text = merge_expositions(parent.render().decode(), [child.render().decode()])
    assert sample_value(text, "pdserve_requests_total", {"status": "ok"}) == 8
    assert sample_value(text, "pdserve_requests_total", {"status": "unavailable"}) == 1
    assert sample_value(text, "pdserve_prompt_tokens_total") == 80
    assert sample_value(text, "pdserve_inter_token_latency_seconds_count") == 3
    assert abs(sample_value(text, "pdserve_inter_token_latency_seconds_sum") - 0.52) < 1e-9
    buckets = dict(histogram_buckets(text, "pdserve_inter_token_latency_seconds"))
    assert buckets[0.01] == 2 and buckets[float("inf")] == 3
    assert sample_value(text, "pdserve_queue_depth") == 3
    assert sample_value(text, "pdserve_requests_inflight") == 11
    # every router sees the same workers: the parent's view, not a sum of views
    assert sample_value(text, "pdserve_kv_blocks_free", {"worker": "decode-0"}) == 60
    assert sample_value(text, "pdserve_worker_up", {"worker": "decode-0"}) == 1
    assert sample_value(text, "pdserve_redis_up") == 1


def test_a_label_set_only_another_process_has_is_added():
    parent, child = RouterMetrics(), RouterMetrics()
    parent.set_planner_desired("decode", 3)
    child.transfer_latency.observe(0.2)
    parent_text, child_text = parent.render().decode(), child.render().decode()
    extra = ("# HELP pdserve_only_child_total A counter the parent never made.\n"
             "# TYPE pdserve_only_child_total counter\npdserve_only_child_total{x=\"1\"} 4.0\n")
    text = merge_expositions(parent_text, [child_text + extra])
    assert sample_value(text, "pdserve_only_child_total", {"x": "1"}) == 4
    assert sample_value(text, "pdserve_kv_transfer_latency_seconds_count") == 1
    assert sample_value(text, "pdserve_planner_desired_workers", {"role": "decode"}) == 3


def test_nothing_to_merge_gives_the_same_text():
    parent = _router(ok=2, itl=[0.03], queued=0, inflight=1, free_blocks=5, redis_up=True)
    text = parent.render().decode()
    assert merge_expositions(text, []) == text


def test_a_dead_process_leaves_its_totals_not_its_gauges():
    child = _router(ok=4, itl=[0.02], queued=3, inflight=2, free_blocks=1, redis_up=True)
    left = totals_only(child.render().decode())
    assert sample_value(left, "pdserve_requests_total", {"status": "ok"}) == 4
    assert "pdserve_queue_depth" not in left and "pdserve_kv_blocks_free" not in left
    parent = _router(ok=1, itl=[], queued=0, inflight=0, free_blocks=9, redis_up=True)
    text = merge_expositions(parent.render().decode(), [left])
    assert sample_value(text, "pdserve_requests_total", {"status": "ok"}) == 5
    assert sample_value(text, "pdserve_queue_depth") == 0


def test_router_metrics_render_and_scrape_include_sources():
    import urllib.request

    parent = _router(ok=1, itl=[], queued=0, inflight=2, free_blocks=9, redis_up=True)
    child = _router(ok=6, itl=[], queued=0, inflight=3, free_blocks=0, redis_up=True)
    parent.add_source(lambda: [child.render().decode()])
    assert sample_value(parent.render(), "pdserve_requests_total", {"status": "ok"}) == 7
    port = parent.start_http("127.0.0.1", 0)
    try:
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        parent.stop_http()
    assert sample_value(scraped, "pdserve_requests_inflight") == 5
    assert sample_value(scraped, "pdserve_kv_blocks_free", {"worker": "decode-0"}) == 9
