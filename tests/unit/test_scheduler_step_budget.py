"""Scheduler with steps sized in time (`step_target_s`) and shortest-remaining-prefill-first
admission (`scheduling_policy="srpt"`), against the fake runner of test_scheduler: bursts are
split over short steps, short prompts overtake long ones, and outputs stay exact."""

from __future__ import annotations

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.step_budget import COLD_START_TOKENS
from tests.unit.test_scheduler import EOS, FakeRunner, reference, run_random_load

A, B = 0.01, 0.001  # the injected step time: 10 ms + 1 ms per token


def teach(scheduler: Scheduler, a: float = A, b: float = B) -> None:
    """Steps of a few sizes timed on the line a + b * tokens."""
    for n in (8, 64, 200):
        scheduler.observe_step(n, a + b * n)


def make(num_blocks: int = 128, clock=None, **config) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, 4, False)
    kw = {"clock": clock} if clock is not None else {}
    return Scheduler(SchedulerConfig(**config), kv, 256, **kw), FakeRunner(num_blocks, 4)


def burst(scheduler: Scheduler, num: int, length: int = 40) -> list[Request]:
    requests = [Request(f"r{i}", tuple(range(100 * i + 10, 100 * i + 10 + length)),
                        SamplingParams(max_tokens=3), (EOS,)) for i in range(num)]
    for request in requests:
        scheduler.add_request(request)
    return requests


def run(scheduler: Scheduler, runner: FakeRunner) -> tuple[list, dict[str, list[int]]]:
    """To completion: each step's [(id, tokens)], and each request's output tokens."""
    steps, outputs = [], {}
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        steps.append([(e.request_id, e.num_tokens) for e in plan.requests])
        for out in scheduler.update(plan, runner.execute(plan)):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return steps, outputs


def test_a_timed_budget_splits_a_burst_and_the_first_prompt_finishes_first():
    scheduler, runner = make(step_target_s=A + 40 * B)  # 50 ms: 40 tokens a step
    teach(scheduler)
    assert scheduler.step_token_budget() == 40
    requests = burst(scheduler, 8)
    steps, outputs = run(scheduler, runner)
    assert steps[0] == [("r0", 40)]  # the first prompt whole, and it samples its first token
    assert all(sum(n for _, n in step) <= 40 for step in steps)
    first_step = {rid: i for i, step in reversed(list(enumerate(steps))) for rid, _ in step}
    assert first_step["r7"] >= 6  # the burst was spread over many short steps
    for r in requests:
        assert outputs[r.request_id] == reference(list(r.prompt_token_ids), 3, 256)


def test_with_the_token_budget_only_the_burst_is_one_step():
    scheduler, runner = make()
    teach(scheduler)  # observed, but with no target the fit sizes nothing
    assert scheduler.step_token_budget() == 2048
    burst(scheduler, 8)
    steps, _ = run(scheduler, runner)
    assert steps[0] == [(f"r{i}", 40) for i in range(8)]


def test_a_small_budget_cold_then_the_mean_cost_then_the_fitted_line():
    scheduler, _ = make(step_target_s=0.05, max_num_batched_tokens=512)
    assert scheduler.step_token_budget() == COLD_START_TOKENS  # nothing timed yet
    scheduler.observe_step(0, 0.2)  # an empty step teaches nothing
    assert scheduler.step_token_budget() == COLD_START_TOKENS
    scheduler.observe_step(64, 0.07)
    scheduler.observe_step(64, 0.07)
    assert scheduler.step_token_budget() == 45  # 1.09 ms a token on average
    scheduler.observe_step(128, 0.13)  # 10 ms + 0.94 ms/token: 0.05 s is 42 tokens
    assert scheduler.step_token_budget() == 42


def test_running_decodes_always_fit_in_the_timed_budget():
    scheduler, runner = make(step_target_s=A + 2 * B, max_num_seqs=16)  # only 2 tokens "fit"
    teach(scheduler)
    for i in range(10):
        scheduler.add_request(Request(f"d{i}", (10 + i, 20 + i), SamplingParams(max_tokens=6)))
    steps, outputs = run(scheduler, runner)
    assert all(len(outputs[f"d{i}"]) == 6 for i in range(10))
    decode_steps = [s for s in steps if s and all(n == 1 for _, n in s)]
    assert any(len(s) == 10 for s in decode_steps)  # all ten decode together, never starved
    assert scheduler.step_token_budget() == 4  # idle: the floor is one block


def test_srpt_admits_a_short_prompt_that_arrived_after_long_ones():
    now = [0.0]
    scheduler, runner = make(clock=lambda: now[0], scheduling_policy="srpt",
                             max_num_batched_tokens=32)
    teach(scheduler)  # 1000 tokens/s: a 60-token prompt is 60 ms of work
    params = SamplingParams(max_tokens=2)
    long_a = Request("long a", tuple(range(10, 70)), params, arrival_time=0.000)
    long_b = Request("long b", tuple(range(110, 170)), params, arrival_time=0.001)
    short = Request("short", (7, 8, 9, 10, 11), params, arrival_time=0.010)
    for r in (long_a, long_b, short):
        scheduler.add_request(r)
    now[0] = 0.011
    plan = scheduler.schedule()
    assert [(e.request_id, e.num_tokens) for e in plan.requests] == [("short", 5), ("long a", 27)]
    assert plan.requests[0].sampling_params is not None  # its first token comes in step one
    (first,) = scheduler.update(plan, runner.execute(plan))
    _, outputs = run(scheduler, runner)
    outputs["short"] = [*first.new_token_ids, *outputs["short"]]
    for r in (long_a, long_b, short):
        assert outputs[r.request_id] == reference(list(r.prompt_token_ids), 2, 256)


def test_fcfs_admits_in_arrival_order():
    scheduler, _ = make(max_num_batched_tokens=32)
    teach(scheduler)
    params = SamplingParams(max_tokens=2)
    scheduler.add_request(Request("long a", tuple(range(10, 70)), params))
    scheduler.add_request(Request("short", (7, 8, 9, 10, 11), params))
    plan = scheduler.schedule()
    assert [(e.request_id, e.num_tokens) for e in plan.requests] == [("long a", 32)]


def test_srpt_ages_a_long_prompt_ahead_of_newer_short_ones():
    now = [0.0]
    scheduler, runner = make(clock=lambda: now[0], scheduling_policy="srpt",
                             max_num_batched_tokens=8, max_num_seqs=1)
    teach(scheduler)  # 1 ms a token: the long prompt is 60 ms of work
    scheduler.add_request(Request("long", tuple(range(10, 70)), SamplingParams(max_tokens=1),
                                  arrival_time=0.0))
    admitted = []
    for step in range(200):  # a new 4-token prompt every 10 ms; one sequence at a time
        now[0] = step * 0.01
        scheduler.add_request(Request(f"s{step}", (1, 2, 3, 4 + step),
                                      SamplingParams(max_tokens=1), arrival_time=now[0]))
        plan = scheduler.schedule()
        admitted += [e.request_id for e in plan.requests if e.num_computed_tokens == 0]
        scheduler.update(plan, runner.execute(plan))
        if "long" in admitted:
            break
    # it waits while newer prompts have less work than it has waited-for, then goes
    assert admitted[0] == "s0" and "long" in admitted
    assert 0.055 <= now[0] <= 0.08


def test_random_load_with_timed_steps_and_srpt_gives_exact_outputs():
    for seed in range(5):
        run_random_load(seed, prefix_caching=True,
                        config=SchedulerConfig(6, 24, step_target_s=0.0025,
                                               scheduling_policy="srpt"))


def test_random_load_with_srpt_and_lora_adapters():
    for seed in range(3):
        run_random_load(seed, prefix_caching=False, max_loras=2,
                        config=SchedulerConfig(6, 24, scheduling_policy="srpt"))
