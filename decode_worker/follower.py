"""A decode TP rank other than 0: receives its KV-head shard and executes rank 0's plans."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.plan_broadcast import follow
from pdserve.kvtransfer.descriptor import TransferDescriptor
from pdserve.kvtransfer.errors import TransferError
from pdserve.kvtransfer.receiver import KVReceiver

logger = logging.getLogger(__name__)


def admission_votes(receiver: KVReceiver, body: dict[str, Any]) -> torch.Tensor:
    """1 for each proposed transfer that failed on this rank, after waiting for it."""
    votes = torch.zeros(len(body["transfers"]), dtype=torch.int64)
    for i, (transfer_hex, deadline) in enumerate(body["transfers"]):
        try:
            landed = receiver.wait(bytes.fromhex(transfer_hex), max(deadline - time.time(), 0))
        except TransferError as exc:
            logger.warning("transfer %s failed on this rank: %s", transfer_hex, exc)
            landed = False
        votes[i] = 0 if landed else 1
    return votes


def run_follower(runner: ModelRunner, tp: TensorParallel, receiver: KVReceiver) -> None:
    """Serve rank 0 until it stops the group."""

    def expect(body: dict[str, Any]) -> None:
        receiver.expect(TransferDescriptor.decode(body["descriptor"]))

    def admit(body: dict[str, Any]) -> None:
        tp.all_reduce(admission_votes(receiver, body))

    def cancel(body: dict[str, Any]) -> None:
        receiver.cancel(bytes.fromhex(body["transfer"]), body.get("reason", "cancelled"))

    try:
        follow(runner, tp, {"expect": expect, "admit": admit, "cancel": cancel})
    finally:
        receiver.close()
