"""What the router writes down for a migrated request: the request it places again, and the
migrations counter, summed over router processes (router.metrics_merge)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.metrics import RouterMetrics
from pdserve.router.metrics_merge import merge_expositions
from pdserve.router.validation import ValidRequest

REQ = ValidRequest("r", (5, 6, 7), SamplingParams(temperature=0.7, seed=3, max_tokens=10,
                                                  stop=("x",)), "s")


def test_continued_request_carries_the_streamed_tokens_as_its_prompt_tail() -> None:
    moved = REQ.continued([40, 41, 42, 43])
    assert moved.prompt_token_ids == (5, 6, 7, 40, 41, 42, 43)
    assert moved.num_output_tokens == 4
    assert moved.params.max_tokens == 6
    # everything else about the request is the client's
    assert (moved.request_id, moved.session_id) == ("r", "s")
    assert (moved.params.seed, moved.params.temperature, moved.params.stop) == (3, 0.7, ("x",))
    assert REQ.num_output_tokens == 0 and REQ.params.max_tokens == 10  # not changed


def test_continued_with_nothing_streamed_is_the_same_request() -> None:
    assert REQ.continued([]) == REQ


@pytest.mark.parametrize("num_done", [10, 11])
def test_continued_refuses_a_finished_request(num_done) -> None:
    with pytest.raises(ValueError, match="continues after"):
        REQ.continued(list(range(num_done)))


def _migrations(text: str) -> dict[str, float]:
    family = next(f for f in text_string_to_metric_families(text)
                  if f.name == "pdserve_router_migrations")
    return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}


def test_migrations_counted_by_outcome_and_summed_over_router_processes() -> None:
    first, second = RouterMetrics(), RouterMetrics()
    assert _migrations(first.render().decode()) == {"ok": 0, "failed": 0}  # exported at 0
    first.count_migration("ok")
    first.count_migration("failed")
    for _ in range(2):
        second.count_migration("ok")
    merged = merge_expositions(first.render().decode(), [second.render().decode()])
    assert _migrations(merged) == {"ok": 3, "failed": 1}
    with pytest.raises(ValueError, match="outcome"):
        first.count_migration("maybe")
