"""What adaptive placement reads of a worker (router.placement's options): its last load report
(WorkerLoad, as a worker's GetLoad fills it) and what the router sent it since."""

from __future__ import annotations

import math
from types import SimpleNamespace

from pdserve.engine.step_budget import StepFit
from pdserve.proto import worker_pb2
from pdserve.router.placement import _decode_option, _prefill_option

PROMPT_LINE = StepFit(0.0, 0.002)  # the prefill worker's


def decode_client(pending_tokens: int = 0, **load) -> SimpleNamespace:
    fields = {"num_running": 3, "num_prefill_tokens": 40, "step_token_budget": 512} | load
    return SimpleNamespace(worker_id="d", load=worker_pb2.WorkerLoad(**fields),
                           num_pending=(9, 2, pending_tokens))


def test_a_decode_worker_that_timed_prompts_is_priced_at_its_own_fit():
    c = decode_client(pending_tokens=60, prefill_s_per_token=0.001, step_intercept_s=0.01,
                      step_slope_fitted=True, decode_s_per_token=0.003)
    option = _decode_option(c, 100, 0.25, PROMPT_LINE)
    assert option.fit == StepFit(0.01, 0.001, 0.003)
    # its reported queue plus what was sent since; the sequences it reported running
    assert (option.num_queued_tokens, option.num_uncached_tokens) == (100, 100)
    assert (option.num_decoding, option.budget, option.wait_s) == (3, 512, 0.25)


def test_a_decode_worker_that_only_decoded_gets_the_prefill_workers_prompt_slope():
    c = decode_client(prefill_s_per_token=0.004, step_intercept_s=0.01,
                      decode_s_per_token=0.004)  # its slope: a decode token's
    assert _decode_option(c, 100, 0.0, PROMPT_LINE).fit == StepFit(0.01, 0.002, 0.004)
    # nothing to borrow, or nothing of its own: no fit (decide borrows the whole line)
    assert _decode_option(c, 100, 0.0, None).fit is None
    unmeasured = decode_client(prefill_s_per_token=0.004)
    assert _decode_option(unmeasured, 100, 0.0, PROMPT_LINE).fit is None


def test_a_negative_intercept_is_read_as_none():
    c = decode_client(prefill_s_per_token=0.001, step_intercept_s=-0.002,
                      step_slope_fitted=True)
    assert _decode_option(c, 10, 0.0, None).fit == StepFit(0.0, 0.001, None)


def test_a_prefill_worker_is_priced_at_its_mean_cost_before_its_slope_is_fitted():
    load = worker_pb2.WorkerLoad(prefill_s_per_token=0.002, step_token_budget=256)
    c = SimpleNamespace(worker_id="p", load=load, num_inflight_tokens=700)
    option = _prefill_option(c, 300)
    assert option.fit == StepFit(0.0, 0.002, None)
    assert (option.num_queued_tokens, option.num_uncached_tokens, option.budget) == (
        700, 300, 256)
    assert option.num_decoding == 0
    silent = SimpleNamespace(worker_id="p", load=None, num_inflight_tokens=0)
    assert _prefill_option(silent, 300).fit is None


def test_a_fit_that_is_not_a_number_reads_as_none():
    for bad in ({"step_intercept_s": math.nan}, {"prefill_s_per_token": math.inf},
                {"decode_s_per_token": math.nan}):
        c = decode_client(**{"prefill_s_per_token": 0.001, "step_slope_fitted": True} | bad)
        assert _decode_option(c, 10, 0.0, PROMPT_LINE).fit is None
    negative = decode_client(prefill_s_per_token=0.001, step_slope_fitted=True,
                             decode_s_per_token=-0.001)
    assert _decode_option(negative, 10, 0.0, None).fit == StepFit(0.0, 0.001, None)
