"""A decode TP rank other than 0: receives its KV-head shard and executes rank 0's plans."""

from __future__ import annotations

import logging

from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.plan_broadcast import follow
from pdserve.kvtransfer.receive_connector import follower_handlers
from pdserve.kvtransfer.receiver import KVReceiver

logger = logging.getLogger(__name__)


def run_follower(runner: ModelRunner, tp: TensorParallel, receiver: KVReceiver) -> None:
    """Serve rank 0 until it stops the group: its plans, and its transfers' expect / admit /
    cancel (rank 0's KVReceiveConnector sends them)."""
    try:
        follow(runner, tp, follower_handlers(receiver, tp))
    finally:
        receiver.close()
