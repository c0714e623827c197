"""coalesce: a reader's backlog of engine steps merged into one message, nothing lost or moved."""

from __future__ import annotations

import random

from pdserve.decode_worker.coalesce import coalesce
from pdserve.proto import pdserve_pb2, worker_pb2


def _steps(seed: int) -> list[worker_pb2.StepOutputs]:
    """Random steps over 6 requests: 1-2 tokens each per step while running, then a finish."""
    rng = random.Random(seed)
    left = {f"r{i}": rng.randrange(1, 9) for i in range(6)}
    steps, next_token = [], 0
    while left:
        deltas = []
        for rid in rng.sample(sorted(left), k=len(left)):
            n = min(left[rid], rng.choice([1, 1, 2]))
            tokens = list(range(next_token, next_token + n))
            next_token += n
            left[rid] -= n
            done = left[rid] == 0
            deltas.append(worker_pb2.RequestDelta(
                request_id=rid, token_ids=tokens,
                logprobs=[pdserve_pb2.TokenLogprob(token_id=t, logprob=-t) for t in tokens],
                finish_reason="stop" if done else "", stop_reason="7" if done else "",
                num_cached_tokens=len(steps)))
            if done:
                del left[rid]
        steps.append(worker_pb2.StepOutputs(deltas=deltas))
    return steps


def _per_request(steps: list[worker_pb2.StepOutputs]) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for step in steps:
        for d in step.deltas:
            tokens, logprobs, _ = out.get(d.request_id, ([], [], None))
            out[d.request_id] = (tokens + list(d.token_ids),
                                 logprobs + [lp.token_id for lp in d.logprobs],
                                 (d.finish_reason, d.stop_reason, d.num_cached_tokens))
    return out


def test_a_backlog_merges_into_one_delta_per_request_in_order() -> None:
    for seed in range(20):
        steps = _steps(seed)
        expected = _per_request([worker_pb2.StepOutputs().FromString(s.SerializeToString())
                                 for s in steps])
        cut = random.Random(seed).randrange(1, len(steps) + 1)
        head, tail = coalesce(steps[:cut]), coalesce(steps[cut:]) if steps[cut:] else None
        merged = [head] + ([tail] if tail is not None else [])
        assert _per_request(merged) == expected  # tokens, logprobs, last finish: all kept
        assert len({d.request_id for d in head.deltas}) == len(head.deltas)


def test_one_step_passes_through() -> None:
    step = _steps(1)[0]
    assert coalesce([step]) is step
