"""Rank 0 of a tensor-parallel group decides; every rank executes the same messages.

Messages travel as JSON bytes over the TP group's broadcast (no pickle): a length, then the
bytes, both CPU tensors, so they ride the group's gloo side even on CUDA, where NCCL carries
only the model's tensors (TensorParallel.broadcast): no host-device copy per message, and a
follower's wait for the next message is a host wait bounded by the group's timeout. A
message is a kind and a body: "plan" (the step to execute, its KV tier copies included),
"stop", "idle", or a kind the follower's owner handles (e.g. the decode worker's "expect" /
"admit" / "cancel").

Every collective of the group has a bounded timeout (so a hung rank fails the step rather
than wedging the group forever). A follower spends rank 0's idle time blocked in the next
broadcast, so an idle rank 0 sends "idle" (a no-op) every `IdleBeat.interval_s`, well within
that timeout: a follower times out only when rank 0 itself is gone or hung.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from pdserve.engine.kv_tiers import TierOps
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import (
    PromptLogprobsTask,
    ScheduledRequest,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], None]
IDLE = "idle"


def encode_plan(plan: SchedulerOutput) -> dict[str, Any]:
    requests = [
        {
            "id": e.request_id,
            "tokens": list(e.token_ids),
            "start": e.num_computed_tokens,
            "blocks": list(e.block_ids),
            "params": _follower_params(e.sampling_params),
            "outputs": e.num_output_tokens,
            "spec": e.num_spec_tokens,
            "prompt_logprobs": dataclasses.asdict(e.prompt_logprobs) if e.prompt_logprobs else None,
            "lora": dataclasses.asdict(e.lora) if e.lora else None,
        }
        for e in plan.requests
    ]
    ops = plan.kv_tiers
    tiers = {
        "loads": [list(x) for x in ops.loads],
        "demotions": [[slot, h.hex(), list(tokens)] for slot, h, tokens in ops.demotions],
        "stores": [list(x) for x in ops.stores],
        "promotions": [[h.hex(), list(tokens), slot] for h, tokens, slot in ops.promotions],
        "deletes": [h.hex() for h in ops.deletes],
    } if ops else None
    return {"requests": requests, "finished": list(plan.finished_request_ids), "tiers": tiers}


def _follower_params(params: SamplingParams | None) -> dict[str, Any] | None:
    """The params as followers need them: rank 0 alone samples, so not the logits
    processing's (a schema or a bias table would cross the group every step)."""
    if params is None:
        return None
    light = dataclasses.replace(params, logit_bias=(), bad_words_token_ids=(),
                                structured_outputs=None)
    return dataclasses.asdict(light)


def decode_plan(body: dict[str, Any]) -> SchedulerOutput:
    requests = tuple(
        ScheduledRequest(
            request_id=str(r["id"]),
            token_ids=tuple(int(t) for t in r["tokens"]),
            num_computed_tokens=int(r["start"]),
            block_ids=tuple(int(b) for b in r["blocks"]),
            sampling_params=SamplingParams(**r["params"]) if r["params"] else None,
            num_output_tokens=int(r["outputs"]),
            num_spec_tokens=int(r["spec"]),
            prompt_logprobs=_task(r.get("prompt_logprobs")),
            lora=LoRARequest(**r["lora"]) if r.get("lora") else None,
        )
        for r in body["requests"]
    )
    return SchedulerOutput(requests, tuple(str(i) for i in body["finished"]),
                           _tier_ops(body.get("tiers")))


def _tier_ops(body: dict[str, Any] | None) -> TierOps:
    if not body:
        return TierOps()

    def ints(xs) -> tuple[int, ...]:
        return tuple(int(x) for x in xs)

    return TierOps(
        loads=tuple(ints(x) for x in body["loads"]),
        demotions=tuple((int(slot), bytes.fromhex(h), ints(tokens))
                        for slot, h, tokens in body["demotions"]),
        stores=tuple(ints(x) for x in body["stores"]),
        promotions=tuple((bytes.fromhex(h), ints(tokens), int(slot))
                         for h, tokens, slot in body["promotions"]),
        deletes=tuple(bytes.fromhex(h) for h in body["deletes"]),
    )


def _task(body: dict[str, Any] | None) -> PromptLogprobsTask | None:
    if body is None:
        return None
    token_ids = tuple(int(t) for t in body["token_ids"])
    return PromptLogprobsTask(int(body["first_position"]), token_ids, int(body["num_top"]))


def publish(tp: TensorParallel, kind: str, body: dict[str, Any] | None = None) -> None:
    """Rank 0: send one message to every other rank of the group."""
    data = json.dumps({"kind": kind, "body": body or {}}, separators=(",", ":")).encode()
    tp.broadcast(torch.tensor([len(data)], dtype=torch.int64))
    tp.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def receive(tp: TensorParallel) -> tuple[str, dict[str, Any]]:
    """Other ranks: the next message from rank 0."""
    size = int(tp.broadcast(torch.zeros(1, dtype=torch.int64)))
    data = tp.broadcast(torch.empty(size, dtype=torch.uint8))
    message = json.loads(data.numpy().tobytes())
    return message["kind"], message["body"]


def publish_plan(tp: TensorParallel, plan: SchedulerOutput) -> None:
    publish(tp, "plan", encode_plan(plan))


def follow(runner, tp: TensorParallel, handlers: dict[str, Handler] | None = None) -> None:
    """A follower rank's whole life: run every plan and message rank 0 sends, until "stop"."""
    handlers = handlers or {}
    while True:
        kind, body = receive(tp)
        if kind == "stop":
            break
        if kind == IDLE:
            continue
        if kind == "plan":
            runner.execute(decode_plan(body))
        else:
            handlers[kind](body)
    logger.info("TP rank %d: stopped by rank 0", tp.rank)


class IdleBeat:
    """Rank 0: an "idle" message at least every `interval_s`, so a follower blocked waiting
    for the next message never reaches the collective timeout while rank 0 merely idles."""

    def __init__(self, tp: TensorParallel, interval_s: float) -> None:
        self.tp, self.interval_s = tp, interval_s
        self._last = time.monotonic()

    def tick(self) -> None:
        """Call from rank 0's loop thread every iteration; sends when one is due."""
        if self.tp.size == 1 or time.monotonic() - self._last < self.interval_s:
            return
        publish(self.tp, IDLE)
        self._last = time.monotonic()
