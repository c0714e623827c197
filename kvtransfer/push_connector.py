"""KVPushConnector: a prefill worker's side of the KV-connector seam, over KVSender.

A request's destination travels with it (`Request.kv_transfer`: the TransferDescriptor the
decode side reserved). The step that computes a prompt's last token pushes every block the
decode side reserved (this side's prefix-cache hits included), but not those the decode side
held already (the descriptor's `first_block`), layer by layer while later layers still
compute: all requests of the step going to one decode rank travel as one message per layer.

The step's push (`_Push`) is the connector's only record of a transfer on this side, and it
lives for that one step: `wait_for_save` waits until every byte has left and each receiver
was told the transfer is complete, before the engine updates, so a request's blocks are
released (kept in the prefix cache) only after their bytes have left. A push that fails
fails only the requests it carried; a forward pass that fails tells every destination.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.kv_connector import KVConnector, KVConnectorEvents
from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import KVSaveResult, SchedulerOutput
from pdserve.kvtransfer.connector import Connector
from pdserve.kvtransfer.descriptor import TransferDescriptor
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.layout import KVLayout, transfer_view
from pdserve.kvtransfer.sender import KVSender, PushHandle, PushPlan

logger = logging.getLogger(__name__)


@dataclass
class _Push:
    """One step's outgoing KV: a plan per destination rank and what was posted for it."""

    plans: list[PushPlan]
    destinations: dict[str, TransferDescriptor]  # request id -> where its KV goes
    handles: list[PushHandle] = field(default_factory=list)
    failed: dict[bytes, TransferError] = field(default_factory=dict)  # by transfer id
    started: float | None = None  # perf_counter when the first layer was pushed


class KVPushConnector(KVConnector):
    """Pushes this (TP 1) prefill worker's KV through `transport` (its channel identity)."""

    def __init__(self, layout: KVLayout, transport: Connector) -> None:
        self.layout = layout
        self.endpoint = transport.source
        self._transport = transport
        self.sender: KVSender | None = None  # once the cache exists (register_kv_caches)
        self._push: _Push | None = None

    # ---- scheduler side: a prefill worker holds no transfer between steps ----

    def reserve(self, request: Request, block_ids: Sequence[int]) -> object:
        raise ValueError("a prefill worker pushes KV out; it reserves no blocks for incoming KV")

    def poll(self) -> KVConnectorEvents:
        """Nothing arrives here."""
        return KVConnectorEvents()

    def request_finished(self, request: Request) -> None:
        """Nothing outlives its step: a push is complete or failed before the step returns."""

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: Sequence[tuple[torch.Tensor, ...]]) -> None:
        self.sender = KVSender(self.layout, self._transport, 1,
                               transfer_view(self.layout, kv_caches))

    def start_save(self, plan: SchedulerOutput) -> None:
        """Plan the pushes of the requests whose prompt this step completes."""
        finals = [e for e in plan.requests if e.kv_transfer is not None]
        self._push = None
        if not finals:
            return
        for entry in finals:
            if not isinstance(entry.kv_transfer, TransferDescriptor):
                raise ValueError(f"{entry.request_id}: kv_transfer must be the decode side's "
                                 f"TransferDescriptor, got {type(entry.kv_transfer).__name__}")
        # the decode side holds the request's blocks before first_block: only the rest goes
        plans = self._sender().plan([(e.kv_transfer, e.block_ids[e.kv_transfer.first_block:])
                                     for e in finals])
        self._push = _Push(plans, {e.request_id: e.kv_transfer for e in finals})

    def save_kv_layer(self, layer: int) -> None:
        """Post this layer of every live plan; returns at once (the bytes move meanwhile)."""
        push = self._push
        if push is None:
            return
        if push.started is None:
            push.started = time.perf_counter()
        for plan in push.plans:
            if any(t in push.failed for t in plan.transfer_ids):
                continue
            try:
                push.handles.append(self._sender().push_layer(layer, plan))
            except TransferError as exc:  # this destination only; the others go on
                push.failed.update((t, exc) for t in plan.transfer_ids)

    def wait_for_save(self) -> dict[str, KVSaveResult]:
        """Wait until every pushed byte has left, then tell each receiver its transfers are
        done (it checks nothing is missing). Returns how each request's push went."""
        push, self._push = self._push, None
        if push is None:
            return {}
        for handle in push.handles:
            try:
                handle.wait()
            except TransferError as exc:
                push.failed.update((t, exc) for t in handle.plan.transfer_ids)
        for plan in push.plans:
            if any(t in push.failed for t in plan.transfer_ids):
                continue
            try:
                self._sender().finish(plan).wait()
            except TransferError as exc:
                push.failed.update((t, exc) for t in plan.transfer_ids)
        seconds = time.perf_counter() - push.started if push.started is not None else 0.0
        return {rid: self._result(desc, seconds, push.failed.get(desc.transfer_id))
                for rid, desc in push.destinations.items()}

    def abort_save(self) -> None:
        """Best effort: tell every destination of this step to fail its transfers now, then
        let the posted sends drain (they read the blocks the engine is about to free)."""
        push, self._push = self._push, None
        if push is None:
            return
        self._sender().abort(push.plans, ErrorCode.PREFILL_FAILED)
        for handle in push.handles:
            with contextlib.suppress(TransferError):
                handle.wait()

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        else:
            self._transport.close()

    def _result(self, desc: TransferDescriptor, seconds: float,
                error: TransferError | None) -> KVSaveResult:
        return KVSaveResult(desc.pushed_nbytes(self.layout), seconds,
                            None if error is None else str(error))

    def _sender(self) -> KVSender:
        assert self.sender is not None, "register_kv_caches comes first"
        return self.sender
