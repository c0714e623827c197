"""Steps sized in time and SRPT admission on the tiny model: the same greedy fp32 tokens as
first-come-first-served under the token budget, over more, smaller steps; every step's
timing reaches the scheduler's fit, and the worker's stats report the step budget.

The tiny model's per-token cost is lost in timing noise, so the timed engine sizes its steps
by a fixed line (a stand-in for its step-time model): the chunking is the same on any
machine. The real model and its feeding are checked on the FCFS engine."""

from __future__ import annotations

import math
import random

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, load_model_config
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step_budget import StepFit
from pdserve.engine.worker_stats import WorkerStats

LENGTHS = (120, 90, 5, 60, 12, 150, 30, 8)


class FixedLine:
    """A step-time model that has learnt 1 ms + 1 ms a token and learns nothing more (slow
    enough that a token more of work outweighs the microseconds between arrivals)."""

    slope_fitted, decode_slope_fitted = True, False

    def observe(self, num_tokens: int, seconds: float, num_decodes: int = 0) -> None:
        pass

    def fit(self) -> StepFit:
        return StepFit(1e-3, 1e-3)


def engine(path, scheduler: SchedulerConfig) -> LLMEngine:
    config = EngineConfig(
        model=load_model_config(path, "float32", max_model_len=256),
        cache=CacheConfig(block_size=16, num_blocks=96, enable_prefix_caching=False),
        scheduler=scheduler, num_threads=2,
    )
    return LLMEngine(config, None)


def run_burst(engine: LLMEngine) -> tuple[dict[str, list[int]], list[str], list[int]]:
    """Eight prompts of mixed lengths queued at once: each one's tokens, the order in which
    their first tokens came, and the tokens each step computed."""
    rng = random.Random(3)
    for i, length in enumerate(LENGTHS):
        prompt = [rng.randrange(3, 40000) for _ in range(length)]
        engine.add_request(f"r{i}", prompt,
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outputs, first, step_tokens = {}, [], []
    stats = engine.core.scheduler.stats
    while engine.has_unfinished_requests():
        before = stats.num_computed_tokens
        for out in engine.step():
            if out.request_id not in first:
                first.append(out.request_id)
            if out.finished:
                outputs[out.request_id] = out.token_ids
        step_tokens.append(stats.num_computed_tokens - before)
    return outputs, first, step_tokens


def test_timed_steps_and_srpt_keep_greedy_outputs(tiny_llama_dir):
    fcfs = engine(tiny_llama_dir, SchedulerConfig(8, 512))
    expected, fcfs_first, fcfs_steps = run_burst(fcfs)
    assert fcfs_steps[0] == sum(LENGTHS)  # the whole burst in one step
    timed = engine(tiny_llama_dir, SchedulerConfig(8, 512, step_target_s=1e-3 + 64e-3,
                                                   scheduling_policy="srpt"))
    timed.core.scheduler.step_time = FixedLine()  # 64 tokens a step (decodes always run)
    got, first, steps = run_burst(timed)
    assert got == expected
    assert max(steps) == 64 and len(steps) > len(fcfs_steps) + 5
    assert first[:4] == ["r2", "r7", "r4", "r6"]  # 5, 8, 12, 30 tokens: all in step one
    assert fcfs_first[:3] == ["r0", "r1", "r2"]
    assert WorkerStats.from_core(timed.core).step_token_budget == 64


def test_every_step_that_computed_reaches_the_fit(tiny_llama_dir):
    fcfs = engine(tiny_llama_dir, SchedulerConfig(8, 512))
    _, _, steps = run_burst(fcfs)
    model = fcfs.core.scheduler.step_time
    assert model.num_observations == sum(1 for n in steps if n > 0) == len(steps)
    # a 475-token prompt step, then decode steps of 8 down to 1: both kinds of tokens seen (the
    # tiny model's prompt tokens cost next to nothing: no sign is asserted)
    fit = model.fit()
    assert model.decode_slope_fitted and math.isfinite(fit.intercept_s + fit.per_token_s)
    assert fcfs.core.scheduler.step_token_budget() == 512  # no target: the token budget
