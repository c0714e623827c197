"""The router's count of KV bytes not shipped because the decode worker held them (issue 18):
per router process, and summed over router processes as the service's /metrics shows it."""

from __future__ import annotations

import pytest

from pdserve.router.metrics import RouterMetrics
from pdserve.router.metrics_merge import merge_expositions, totals_only
from pdserve.router.metrics_text import sample_value

SKIPPED = "pdserve_kv_transfer_skipped_bytes_total"


def test_skipped_bytes_count_beside_shipped_ones():
    m = RouterMetrics()
    assert sample_value(m.render().decode(), SKIPPED) == 0  # exported before any transfer
    m.observe_transfer(4096, 0.01)  # a first turn: nothing held
    m.observe_transfer(1024, 0.02, skipped_bytes=3072)
    text = m.render().decode()
    assert sample_value(text, "pdserve_kv_transfer_bytes_total") == 5120
    assert sample_value(text, SKIPPED) == 3072
    with pytest.raises(ValueError, match="skipped_bytes"):
        m.observe_transfer(1, 0.1, skipped_bytes=-1)


def test_router_processes_sum_their_skipped_bytes():
    parent, child, gone = RouterMetrics(), RouterMetrics(), RouterMetrics()
    parent.observe_transfer(100, 0.1, skipped_bytes=700)
    child.observe_transfer(100, 0.1, skipped_bytes=50)
    gone.observe_transfer(100, 0.1, skipped_bytes=5)  # a router process that ended
    text = merge_expositions(parent.render().decode(), [
        child.render().decode(), totals_only(gone.render().decode())])
    assert sample_value(text, SKIPPED) == 755
