"""Prompt logprobs in the scheduler, the request and the output, with the model faked.

The fake runner answers each PromptLogprobsTask with logprob = -position after checking, in
its token-level KV cache, that the context before each position is the prompt's: so chunk
boundaries, preemption (no position twice, none missed) and prefix-cache skipping show in
the positions each request's first output carries.
"""

from __future__ import annotations

import json
import random

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.outputs import Logprob
from pdserve.engine.plan_broadcast import decode_plan, encode_plan
from pdserve.engine.prompt_logprobs import output_prompt_logprobs, prompt_logprob_rows
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import (
    PromptLogprobsTask,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from pdserve.wire import (
    logprobs_from_proto,
    logprobs_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from tests.unit.test_scheduler import EOS, VOCAB, FakeRunner


class PromptLogprobsRunner(FakeRunner):
    def __init__(self, num_blocks: int, block_size: int, prompts: dict[str, tuple[int, ...]]):
        super().__init__(num_blocks, block_size)
        self.prompts = prompts
        self.num_skipping_tasks = 0  # tasks starting past their chunk's first row (recompute)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        result = super().execute(plan)
        answers = {}
        for e in plan.requests:
            task = e.prompt_logprobs
            if task is None:
                continue
            prompt = self.prompts[e.request_id]
            self.num_skipping_tasks += task.first_position > e.num_computed_tokens + 1
            positions = range(task.first_position, task.first_position + len(task.token_ids))
            context = self.cache[self.slots(e.block_ids, range(positions[-1]))].tolist()
            assert context == list(prompt[: positions[-1]]), e.request_id
            assert task.token_ids == prompt[positions[0]: positions[-1] + 1]
            answers[e.request_id] = tuple(
                TokenLogprobs(t, -float(p), (), p) for p, t in zip(positions, task.token_ids))
        return RunnerOutput(result.sampled_token_ids, {}, prompt_logprobs=answers)


def test_tasks_cover_each_prompt_position_once_across_chunks() -> None:
    request = Request("r", tuple(range(100, 110)), SamplingParams(prompt_logprobs=2))
    assert request.needs_prompt_logprobs
    task = request.prompt_logprobs_task(0, 4)  # rows 0..3 predict positions 1..4
    assert task == PromptLogprobsTask(1, (101, 102, 103, 104), 2)
    request.add_prompt_logprobs(task, tuple(TokenLogprobs(t, -1.0) for t in task.token_ids))
    # the next chunk's first row predicts position 5; its last stops at the prompt's end
    assert request.prompt_logprobs_task(4, 6) == PromptLogprobsTask(5, tuple(range(105, 110)), 2)
    # recomputed after a preemption: the held positions are not asked again
    assert request.prompt_logprobs_task(0, 3) is None
    assert request.prompt_logprobs_task(0, 8).first_position == 5
    assert Request("one", (5,), SamplingParams(prompt_logprobs=0)).prompt_logprobs_task(0, 1) \
        is None
    assert Request("off", (5, 6), SamplingParams()).prompt_logprobs_task(0, 2) is None


def run_load(seed: int) -> int:
    rng = random.Random(seed)
    block_size, num_blocks, max_model_len = 4, 30, 160
    kv = KVCacheManager(num_blocks, block_size, True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16), kv,
                          max_model_len)
    shared = [rng.randrange(8, VOCAB) for _ in range(40)]
    requests = []
    for i in range(30):
        prompt = shared[: rng.randrange(0, 41)] + [
            rng.randrange(8, VOCAB) for _ in range(rng.randrange(1, 30))]
        if requests and rng.random() < 0.3:
            prompt = list(rng.choice(requests).prompt_token_ids)
        k = rng.choice([None, None, 0, 3])
        params = SamplingParams(max_tokens=rng.randrange(1, 30), prompt_logprobs=k)
        requests.append(Request(str(i), tuple(prompt), params, (EOS,)))
    runner = PromptLogprobsRunner(num_blocks, block_size,
                                  {r.request_id: r.prompt_token_ids for r in requests})
    carried: dict[str, list] = {}
    pending = list(requests)
    for _ in range(5000):
        if not (pending or scheduler.has_unfinished_requests()):
            break
        for _ in range(rng.randrange(0, 3)):
            if pending:
                scheduler.add_request(pending.pop(0))
        plan = scheduler.schedule()
        for out in scheduler.update(plan, runner.execute(plan)):
            if out.prompt_logprobs is not None:
                carried.setdefault(out.request_id, []).append(out)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.stats.num_preemptions > 0 and scheduler.stats.num_cached_tokens > 0
    for r in requests:
        if r.sampling_params.prompt_logprobs is None:
            assert r.request_id not in carried
            continue
        [out] = carried[r.request_id]  # once: on the output of the first token
        assert out.num_cached_tokens == 0 and out.new_token_ids == (r.output_token_ids[0],)
        want = [(t, -float(p), p) for p, t in enumerate(r.prompt_token_ids[1:], 1)]
        assert [(lp.token_id, lp.logprob, lp.rank) for lp in out.prompt_logprobs] == want
    assert kv.num_free_blocks == num_blocks
    return runner.num_skipping_tasks


def test_prompt_logprobs_under_load_preemption_and_prefix_cache() -> None:
    assert sum(run_load(seed) for seed in range(6)) > 0, "no prompt was recomputed"


def test_blocks_of_a_prompt_logprobs_request_are_published_not_looked_up() -> None:
    kv = KVCacheManager(16, 4, True)
    scheduler = Scheduler(SchedulerConfig(4, 64), kv, 64)
    prompt = tuple(range(10, 23))
    runner = PromptLogprobsRunner(16, 4, {"a": prompt, "b": prompt, "c": prompt})
    for rid, k in (("a", 1), ("b", 1), ("c", None)):
        scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=1,
                                                                  prompt_logprobs=k)))
        plan = scheduler.schedule()
        [out] = scheduler.update(plan, runner.execute(plan))
        assert out.num_cached_tokens == (12 if rid == "c" else 0), rid
        assert (out.prompt_logprobs is None) == (k is None)


def test_output_shape_is_vllms() -> None:
    prompt = (7, 8, 9)
    entries = (TokenLogprobs(8, -0.5, ((8, -0.5), (3, -1.5)), 1),
               TokenLogprobs(9, -4.0, ((2, -0.1), (3, -2.5)), 5))
    out = output_prompt_logprobs(prompt, entries, lambda t: f"<{t}>")
    assert out[0] is None
    assert out[1] == {8: Logprob(-0.5, 1, "<8>"), 3: Logprob(-1.5, 2, "<3>")}
    assert list(out[2]) == [9, 2, 3]  # the prompt token first, then the top-n best first
    assert out[2][9] == Logprob(-4.0, 5, "<9>") and out[2][3].rank == 2
    assert output_prompt_logprobs((4,), (), lambda t: None) == [None]


def test_rows_follow_the_plan_order_and_each_chunk_start() -> None:
    entries = [
        ScheduledRequest("d", (5,), 9, (0,), SamplingParams()),
        ScheduledRequest("p", (1, 2, 3, 4), 8, (1, 2, 3), None,
                         prompt_logprobs=PromptLogprobsTask(10, (3, 4, 6), 0)),
    ]
    assert prompt_logprob_rows(entries) == [1 + 1, 1 + 2, 1 + 3]


def test_plan_codec_carries_the_task() -> None:
    task = PromptLogprobsTask(3, (4, 5), 2)
    plan = SchedulerOutput((ScheduledRequest("a", (1, 2, 3), 2, (0,), None,
                                             prompt_logprobs=task),))
    assert decode_plan(json.loads(json.dumps(encode_plan(plan)))) == plan


def test_grpc_carries_prompt_logprobs_and_their_rank() -> None:
    params = SamplingParams(prompt_logprobs=3, logprobs=1)
    assert sampling_from_proto(sampling_to_proto(params), default_max_tokens=16) == params
    assert not sampling_to_proto(SamplingParams()).HasField("prompt_logprobs")
    lp = TokenLogprobs(5, -1.5, ((5, -1.5), (9, -2.0)), rank=1)
    assert logprobs_from_proto(logprobs_to_proto(lp)) == lp
    assert logprobs_from_proto(logprobs_to_proto(TokenLogprobs(5, -1.5))).rank is None
