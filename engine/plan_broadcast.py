"""Rank 0 of a tensor-parallel group schedules; every rank executes the same plan.

The plan travels as JSON bytes over the TP group's broadcast (no pickle): a length, then
the bytes. A zero length tells followers to stop.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import torch

from engine.models.parallel import TensorParallel
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


def encode_plan(plan: SchedulerOutput) -> bytes:
    requests = [
        {
            "id": e.request_id,
            "tokens": list(e.token_ids),
            "start": e.num_computed_tokens,
            "blocks": list(e.block_ids),
            "params": dataclasses.asdict(e.sampling_params) if e.sampling_params else None,
        }
        for e in plan.requests
    ]
    body = {"requests": requests, "finished": list(plan.finished_request_ids)}
    return json.dumps(body, separators=(",", ":")).encode()


def decode_plan(data: bytes) -> SchedulerOutput:
    body = json.loads(data)
    requests = tuple(
        ScheduledRequest(
            request_id=str(r["id"]),
            token_ids=tuple(int(t) for t in r["tokens"]),
            num_computed_tokens=int(r["start"]),
            block_ids=tuple(int(b) for b in r["blocks"]),
            sampling_params=SamplingParams(**r["params"]) if r["params"] else None,
        )
        for r in body["requests"]
    )
    return SchedulerOutput(requests, tuple(str(i) for i in body["finished"]))


def publish_plan(tp: TensorParallel, plan: SchedulerOutput | None) -> None:
    """Rank 0: send the step's plan (None: tell followers to stop)."""
    data = encode_plan(plan) if plan is not None else b""
    tp.broadcast(torch.tensor([len(data)], dtype=torch.int64))
    if data:
        tp.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def receive_plan(tp: TensorParallel) -> SchedulerOutput | None:
    """Other ranks: the next plan, or None when rank 0 is shutting the group down."""
    size = tp.broadcast(torch.zeros(1, dtype=torch.int64))
    if int(size) == 0:
        return None
    data = tp.broadcast(torch.empty(int(size), dtype=torch.uint8))
    return decode_plan(data.numpy().tobytes())


def follow_plans(runner, tp: TensorParallel) -> None:
    """A follower rank's whole life: execute every plan rank 0 publishes, until told to stop."""
    while (plan := receive_plan(tp)) is not None:
        runner.execute(plan)
    logger.info("TP rank %d: stopped by rank 0", tp.rank)
