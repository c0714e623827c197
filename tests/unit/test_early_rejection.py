"""Early rejection (issue 42, admission with foresight): the pure rule, its settings, and what
the fronts answer with it."""

from __future__ import annotations

import pytest

from pdserve.launch.settings import ServeSettings
from pdserve.router.config import RouterConfig
from pdserve.router.openai.errors import error_body, error_headers, status_of
from pdserve.router.placement import TTFTUnmeetable
from pdserve.router.policy import PrefillLoad, RoutingInfo, early_rejection

SLO = 1.0


def info(num_prompt_tokens: int, hits: dict[str, int] | None = None) -> RoutingInfo:
    return RoutingInfo(num_prompt_tokens, 0, prefix_hits=hits or {})


@pytest.mark.parametrize("queued, prompt, hits, rate, expected", [
    (0, 100, 0, 0.001, None),  # 0.1 s: well within
    (900, 100, 0, 0.001, None),  # exactly the SLO: admitted
    (1900, 100, 0, 0.001, 1.0),  # 2 s: a second past it
    (1900, 100, 100, 0.001, 0.9),  # its own prompt cached there: 1.9 s
    (5000, 100, 0, 0.0, None),  # rate not measured: admitted
    (5000, 100, 0, None, None),  # no load report yet: admitted
])
def test_one_prefill_worker(queued, prompt, hits, rate, expected):
    workers = [PrefillLoad("p0", 1, queued)]
    got = early_rejection(workers, info(prompt, {"p0": hits}), {"p0": rate}, SLO)
    assert got == (None if expected is None else pytest.approx(expected))


def test_one_worker_that_can_meet_it_admits():
    workers = [PrefillLoad("busy", 3, 10_000), PrefillLoad("idle", 0, 0)]
    rates = {"busy": 0.001, "idle": 0.001}
    assert early_rejection(workers, info(500), rates, SLO) is None
    # the idle one is slow: both miss, and the retry hint is the better one's miss
    rates["idle"] = 0.004
    assert early_rejection(workers, info(500), rates, SLO) == pytest.approx(1.0)


def test_an_unmeasured_worker_admits_even_beside_a_slow_one():
    workers = [PrefillLoad("slow", 9, 10_000), PrefillLoad("new", 0, 0)]
    assert early_rejection(workers, info(500), {"slow": 0.01, "new": 0.0}, SLO) is None


def test_no_worker_admits():
    assert early_rejection([], info(500), {}, SLO) is None


def test_config_and_settings_need_a_ttft_bound():
    with pytest.raises(ValueError, match="early_rejection needs a TTFT SLO"):
        RouterConfig(early_rejection=True)
    with pytest.raises(ValueError, match="ttft_slo_s must be > 0"):
        RouterConfig(ttft_slo_s=0.0)
    with pytest.raises(ValueError, match="early_rejection needs a TTFT bound"):
        ServeSettings(early_rejection=True, slo="tpot=50")  # a bound, but not on TTFT
    with pytest.raises(ValueError, match="slo: "):
        ServeSettings(slo="ttft=soon")
    settings = ServeSettings(slo="ttft=250,tpot=50", early_rejection=True)
    assert (settings.ttft_slo_s(), settings.tpot_slo_s()) == (0.25, 0.05)
    assert ServeSettings().ttft_slo_s() is None and not ServeSettings().early_rejection


def test_fronts_answer_429_with_when_to_retry():
    exc = TTFTUnmeetable(2.2, 0.5)
    assert status_of(exc) == (429, "overloaded")
    assert error_headers(exc) == [(b"retry-after", b"3")]  # whole seconds, rounded up
    assert error_headers(TTFTUnmeetable(0.01, 0.5)) == [(b"retry-after", b"1")]
    assert error_body(429, exc)["error"]["type"] == "rate_limit_error"
    assert error_headers(ValueError("x")) == []
