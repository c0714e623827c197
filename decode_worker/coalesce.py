"""coalesce: several engine steps' outputs for one reader merged into one message.

A decode worker sends each router one StepOutputs per engine step while the router keeps up.
When it falls behind (its event loop is saturated, or the link is slow), the steps it has not
read yet wait in its subscription; the next message carries all of them, each request's
deltas joined into one (its tokens and logprobs in order, the finish, stop reason, error and
cached count of its latest delta), so a router that fell behind catches up in one read
instead of reading a message per step it missed. A request's finishing delta is its last, so
nothing is ever merged past it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.proto import worker_pb2


def coalesce(steps: Sequence[worker_pb2.StepOutputs]) -> worker_pb2.StepOutputs:
    """One StepOutputs with every delta of `steps` (oldest first), one delta per request."""
    if len(steps) == 1:
        return steps[0]
    merged: dict[str, worker_pb2.RequestDelta] = {}
    for step in steps:
        for delta in step.deltas:
            into = merged.get(delta.request_id)
            if into is None:
                merged[delta.request_id] = delta
                continue
            into.token_ids.extend(delta.token_ids)
            into.logprobs.extend(delta.logprobs)
            into.finish_reason, into.stop_reason = delta.finish_reason, delta.stop_reason
            into.error, into.num_cached_tokens = delta.error, delta.num_cached_tokens
    return worker_pb2.StepOutputs(deltas=merged.values())
