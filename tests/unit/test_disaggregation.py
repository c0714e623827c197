"""router.disaggregation: remote or local prefill from measured step times, every branch of
the rule and its boundaries, the predictions against a step-by-step simulation of the same
line, and random cases checked against the rule's promises."""

from __future__ import annotations

import math
import random

import pytest

from pdserve.engine.step_budget import StepFit
from pdserve.router.disaggregation import LOCAL, REMOTE, Option, StepCost, decide

LINE = StepFit(0.02, 0.001)  # 20 ms a step + 1 ms a token


def prefill(queued: int, uncached: int, fit: StepFit | None = LINE, budget: int = 512) -> Option:
    return Option("p", queued, uncached, fit, budget)


def decode(queued: int, uncached: int, decoding: int, fit: StepFit | None = LINE,
           budget: int = 512, wait_s: float = 0.0) -> Option:
    return Option("d", queued, uncached, fit, budget, num_decoding=decoding, wait_s=wait_s)


def simulated_prefill_s(fit: StepFit, budget: int, num_tokens: int, decoding: int) -> float:
    """Step by step: each step takes the decodes and as much of the prompt as fits."""
    seconds, left = 0.0, num_tokens
    while left > 0:
        chunk = min(left, max(budget - decoding, 1))
        seconds += fit.seconds(decoding + chunk, decoding)
        left -= chunk
    return seconds


@pytest.mark.parametrize("tokens,decoding,budget", [
    (1, 0, 512), (512, 0, 512), (513, 0, 512), (1000, 7, 64), (5, 64, 64), (300, 100, 64)])
def test_prefill_time_is_the_step_by_step_sum(tokens, decoding, budget) -> None:
    cost = StepCost(LINE, budget)
    assert cost.prefill_s(tokens, decoding) == pytest.approx(
        simulated_prefill_s(LINE, budget, tokens, decoding))


def test_nothing_to_prefill_takes_no_time() -> None:
    assert StepCost(LINE, 16).prefill_s(0, 5) == 0.0


@pytest.mark.parametrize("fit,budget", [
    (StepFit(0.01, 0.0), 16), (StepFit(-0.01, 0.001), 16), (LINE, 0),
    (StepFit(math.nan, 0.001), 16), (StepFit(0.0, math.inf), 16)])
def test_a_cost_that_predicts_nothing_is_refused(fit, budget) -> None:
    with pytest.raises(ValueError, match="step cost"):
        StepCost(fit, budget)


@pytest.mark.parametrize("fallback", [True, False])
def test_unmeasured_workers_follow_the_fixed_rule(fallback) -> None:
    d = decide(prefill(0, 100, fit=None), decode(0, 100, 3, fit=None), fallback)
    assert (d.where, d.reason) == (LOCAL if fallback else REMOTE, "unmeasured")
    assert d.worker_id == ("d" if fallback else "p")
    assert d.ttft_s is None and d.tpot_s is None


def test_idle_workers_of_one_line_prefill_remotely() -> None:
    # the same prediction on both: a tie spares the decode worker
    d = decide(prefill(0, 300), decode(0, 300, 0), False)
    assert (d.where, d.reason) == (REMOTE, "sooner")
    assert d.ttft_s == pytest.approx(LINE.seconds(300))


def test_a_queued_prefill_worker_sends_the_prompt_to_an_idle_decode_worker() -> None:
    d = decide(prefill(2000, 300), decode(0, 300, 0), False)
    assert (d.where, d.worker_id) == (LOCAL, "d")
    assert d.ttft_s == pytest.approx(LINE.seconds(300))
    assert d.tpot_s == pytest.approx(LINE.seconds(1))  # its own decode steps, nobody else's


def test_a_worker_without_a_fit_is_priced_at_the_other_line() -> None:
    slow = StepFit(0.0, 0.01)
    # the decode worker unmeasured: priced at the prefill worker's slow line, it is no sooner
    assert decide(prefill(0, 100, fit=slow), decode(0, 100, 0, fit=None), True).where == REMOTE
    # the prefill worker unmeasured: priced at the decode worker's, whose queue is shorter
    d = decide(prefill(500, 100, fit=None), decode(0, 100, 0, fit=slow), False)
    assert (d.where, d.ttft_s) == (LOCAL, pytest.approx(slow.seconds(100)))


def test_a_sooner_local_prefill_within_the_tpot_slo_goes_local_beside_a_batch() -> None:
    d = decide(prefill(400, 100), decode(0, 100, 4), False, tpot_slo_s=1.0)
    assert (d.where, d.reason) == (LOCAL, "sooner")
    assert d.ttft_s == pytest.approx(simulated_prefill_s(LINE, 512, 100, 4))


def test_a_tpot_slo_the_chunks_would_break_keeps_the_prompt_remote() -> None:
    decoding, work = 8, 300
    local_tpot = LINE.seconds(decoding + work, decoding)  # one step: the prompt beside the batch
    args = (prefill(5000, work), decode(0, work, decoding))
    d = decide(*args, False, tpot_slo_s=local_tpot * 0.999)
    assert (d.where, d.reason) == (REMOTE, "tpot_slo")
    assert d.tpot_s == pytest.approx(LINE.seconds(decoding + 1))
    d = decide(*args, False, tpot_slo_s=local_tpot)
    assert (d.where, d.tpot_s) == (LOCAL, pytest.approx(local_tpot))


def test_small_chunks_keep_the_tpot_within_the_slo() -> None:
    # a budget of 40 tokens: 8 decodes + 32 prompt tokens a step, 10 steps for 300
    d = decide(prefill(5000, 300), decode(0, 300, 8, budget=40), False,
               tpot_slo_s=LINE.seconds(40, 8))
    assert d.where == LOCAL
    assert d.tpot_s == pytest.approx(LINE.seconds(40))
    assert d.ttft_s == pytest.approx(simulated_prefill_s(LINE, 40, 300, 8))


def test_decode_tokens_are_priced_at_their_own_slope() -> None:
    line = StepFit(0.02, 0.001, 0.004)  # a decode token costs four prompt tokens
    d = decide(prefill(5000, 300, fit=line), decode(0, 300, 8, fit=line, budget=40), False,
               tpot_slo_s=1.0)
    assert d.where == LOCAL
    assert d.tpot_s == pytest.approx(0.02 + 0.001 * 32 + 0.004 * 8)
    assert d.ttft_s == pytest.approx(simulated_prefill_s(line, 40, 300, 8))
    assert d.ttft_s == pytest.approx(10 * (0.02 + 0.004 * 8) + 0.001 * 300)


def test_without_a_tpot_slo_local_must_save_more_than_it_costs_the_batch() -> None:
    decoding, work = 4, 100
    local_s = simulated_prefill_s(LINE, 512, work, decoding)
    damage_s = decoding * LINE.per_token_s * work
    # queued tokens on the prefill worker such that remote's TTFT is local's plus the damage
    queued = round((local_s + damage_s - LINE.intercept_s) / LINE.per_token_s) - work
    at = decide(prefill(queued, work), decode(0, work, decoding), False)
    assert (at.where, at.reason) == (REMOTE, "spares_decode")
    beyond = decide(prefill(queued + 1, work), decode(0, work, decoding), False)
    assert (beyond.where, beyond.reason) == (LOCAL, "sooner")


def test_a_prefix_pull_starts_the_local_prefill_when_it_lands() -> None:
    remote_s = simulated_prefill_s(LINE, 512, 600 + 100, 0)
    d = decide(prefill(600, 100), decode(0, 100, 0, wait_s=0.1), False)
    assert (d.where, d.ttft_s) == (LOCAL, pytest.approx(0.1 + LINE.seconds(100)))
    slow_pull = remote_s - LINE.seconds(100) + 1e-6  # the local prefill ends just after
    assert decide(prefill(600, 100), decode(0, 100, 0, wait_s=slow_pull), False).where == REMOTE


def test_the_decode_workers_own_queue_counts() -> None:
    assert decide(prefill(600, 100), decode(0, 100, 0), False).where == LOCAL
    assert decide(prefill(600, 100), decode(700, 100, 0), False).where == REMOTE


@pytest.mark.parametrize("seed", range(5))
def test_random_cases_keep_the_rules_promises(seed) -> None:
    rng = random.Random(seed)
    for _ in range(2000):
        fits = [None if rng.random() < 0.15 else
                StepFit(rng.uniform(0, 0.05), rng.uniform(1e-5, 5e-3)) for _ in range(2)]
        remote = prefill(rng.randrange(0, 4000), rng.randrange(1, 2000), fits[0],
                         rng.choice([64, 256, 2048]))
        local = decode(rng.randrange(0, 1000), rng.randrange(1, 2000),
                       rng.choice([0, 0, 1, 8, 63]), fits[1], rng.choice([64, 256, 2048]),
                       rng.choice([0.0, rng.uniform(0, 2)]))
        tpot_slo = rng.choice([None, rng.uniform(0.01, 1)])
        fallback = rng.random() < 0.5
        d = decide(remote, local, fallback, tpot_slo)
        if fits == [None, None]:
            assert d.where == (LOCAL if fallback else REMOTE) and d.reason == "unmeasured"
            continue
        line_l = fits[1] or fits[0]
        line_r = fits[0] or fits[1]
        remote_s = simulated_prefill_s(line_r, remote.budget, remote.work, 0)
        local_s = local.wait_s + simulated_prefill_s(line_l, local.budget, local.work,
                                                     local.num_decoding)
        assert d.ttft_s == pytest.approx(local_s if d.where == LOCAL else remote_s)
        if d.where == LOCAL:
            assert local_s < remote_s
            if local.num_decoding and tpot_slo is not None:
                assert d.tpot_s <= tpot_slo
            if tpot_slo is None:
                assert remote_s - local_s > local.num_decoding * line_l.per_token_s * local.work
        else:
            assert d.worker_id == "p"
