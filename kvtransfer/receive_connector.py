"""KVReceiveConnector: a decode worker's side of the KV-connector seam, over KVReceiver.

One record per incoming transfer (`_Incoming`, by request id) — the only one on this side —
owned here from `reserve` until the request is admitted, fails, expires or ends. The
receiver's Reservation (kvtransfer.reservation) is the data plane's view of the same
transfer (which cells have landed), internal to it.

    reserve(request, block_ids)   a descriptor for those blocks; every rank expects it. The
                                  first request.num_cached_tokens of them are this worker's
                                  prefix-cache hits: the descriptor's first_block skips them
    start(request_id, token)      the first token, sampled by prefill (a pull, a prefix from
                                  another decode worker, has none: it is ready once landed)
    poll()                        ready: landed on every rank and its first token known;
                                  failed: the transfer failed, or its deadline passed first
    request_finished(request)     abort / finish: the transfer is cancelled on every rank

On a tensor-parallel group rank 0 holds the records and tells the other ranks to expect,
admit or cancel each transfer on their own receivers (`follower_handlers`): a request runs
only once every rank's KV-head shard has landed (an all-reduce of failure votes: CPU
tensors, so on CUDA too they cross the group's gloo side, TensorParallel.all_reduce_host).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.kv_connector import KVArrival, KVConnector, KVConnectorEvents, RemotePrefill
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.plan_broadcast import Handler, publish
from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import KVSaveResult, SchedulerOutput, TokenLogprobs
from pdserve.kvtransfer.connector import Listener
from pdserve.kvtransfer.descriptor import Endpoint, TransferDescriptor
from pdserve.kvtransfer.errors import TransferError
from pdserve.kvtransfer.layout import KVLayout, transfer_view
from pdserve.kvtransfer.receiver import KVReceiver

logger = logging.getLogger(__name__)

EXPIRED = "reservation expired before its KV and first token"


@dataclass
class _Incoming:
    descriptor: TransferDescriptor
    pull: bool  # a prefix pulled from a decode worker: no first token comes
    landed: bool = False  # complete on rank 0
    first_token: int | None = None
    logprobs: TokenLogprobs | None = None

    @property
    def ready(self) -> bool:
        return self.landed and (self.pull or self.first_token is not None)


class KVReceiveConnector(KVConnector):
    """Rank 0 of a decode group: `endpoints` are the listening endpoints of every TP rank."""

    def __init__(self, layout: KVLayout, listener: Listener, endpoints: Sequence[Endpoint],
                 tp: TensorParallel) -> None:
        if len(endpoints) != tp.size:
            raise ValueError(f"{len(endpoints)} KV endpoints for a TP group of {tp.size}: "
                             "one listening endpoint per rank")
        self.layout, self.endpoints, self.tp = layout, tuple(endpoints), tp
        self._listener = listener
        self.receiver: KVReceiver | None = None  # once the cache exists (register_kv_caches)
        self._incoming: dict[str, _Incoming] = {}

    @property
    def num_pending(self) -> int:
        return len(self._incoming)

    def pending_request_ids(self) -> list[str]:
        return list(self._incoming)

    # ---- scheduler side ----

    def reserve(self, request: Request, block_ids: Sequence[int]) -> TransferDescriptor:
        remote = request.kv_transfer
        if not isinstance(remote, RemotePrefill):
            raise ValueError(f"{request.request_id}: a reservation needs kv_transfer="
                             f"RemotePrefill(sources, deadline), got {type(remote).__name__}")
        skip = self._num_held_blocks(request, len(block_ids))
        descriptor = TransferDescriptor.new(
            request.request_id, self.layout, remote.sources,
            [(ep, block_ids[skip:]) for ep in self.endpoints], remote.deadline, skip,
        )
        self._receiver().expect(descriptor)
        if self.tp.size > 1:
            try:
                publish(self.tp, "expect", {"descriptor": descriptor.encode().decode()})
            except BaseException:
                self._receiver().cancel(descriptor.transfer_id, "could not tell the TP group")
                raise
        self._incoming[request.request_id] = _Incoming(descriptor, remote.is_pull)
        return descriptor

    def start(self, request_id: str, first_token: int,
              logprobs: TokenLogprobs | None = None) -> None:
        """The prefill side's first token: the request runs once its KV has landed too."""
        incoming = self._incoming.get(request_id)
        if incoming is None or incoming.pull:
            raise ValueError(f"request_id {request_id!r} has no reservation here")
        incoming.first_token, incoming.logprobs = first_token, logprobs

    def poll(self) -> KVConnectorEvents:
        if not self._incoming:
            return KVConnectorEvents()
        failed = self._landed_or_failed()
        now = time.time()
        for rid, incoming in self._incoming.items():
            if now > incoming.descriptor.deadline and not incoming.ready:
                failed.setdefault(rid, EXPIRED)
        for rid, why in failed.items():
            self._cancel(rid, why)
        ready, lost = self._admit([rid for rid, i in self._incoming.items() if i.ready])
        for rid in lost:
            failed[rid] = "KV transfer failed on another TP rank"
            self._cancel(rid, failed[rid])
        return KVConnectorEvents(tuple(ready), tuple(failed.items()))

    def request_finished(self, request: Request) -> None:
        if request.request_id in self._incoming:
            self._cancel(request.request_id, f"request {request.status.value}")

    # ---- worker side: KV only arrives here, between steps, through the receiver ----

    def register_kv_caches(self, kv_caches: Sequence[tuple[torch.Tensor, ...]]) -> None:
        self.receiver = KVReceiver(self.layout, self._listener, self.tp.size,
                                   transfer_view(self.layout, kv_caches))

    def start_save(self, plan: SchedulerOutput) -> None:
        """A decode worker pushes nothing: no step of it saves KV."""

    def save_kv_layer(self, layer: int) -> None:
        """Nothing leaves a decode worker."""

    def wait_for_save(self) -> dict[str, KVSaveResult]:
        return {}

    def abort_save(self) -> None:
        """No save was started."""

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        else:
            self._listener.close()

    # ---- internals ----

    def _num_held_blocks(self, request: Request, num_blocks: int) -> int:
        """Leading blocks whose KV this worker holds already (prefix-cache hits, counted by
        the scheduler into num_cached_tokens): shared with other requests, so no push may
        land in them, and they are not asked for."""
        cached, block_size = max(request.num_cached_tokens, 0), self.layout.block_size
        num_tokens = request.kv_transfer.num_tokens or request.num_prompt_tokens
        need = -(-num_tokens // block_size)
        if num_blocks != need or cached % block_size or cached >= num_tokens:
            raise ValueError(f"{request.request_id}: {num_blocks} blocks with {cached} cached "
                             f"tokens don't hold the {num_tokens} tokens that come from "
                             f"elsewhere (want {need} blocks and fewer cached tokens, whole "
                             "blocks)")
        return cached // block_size

    def _landed_or_failed(self) -> dict[str, str]:
        """Mark what landed on this rank; returns what failed, by request id."""
        events = self._receiver().poll()
        by_transfer = {i.descriptor.transfer_id: rid for rid, i in self._incoming.items()}
        for transfer_id in events.completed:
            if transfer_id in by_transfer:
                self._incoming[by_transfer[transfer_id]].landed = True
        failed: dict[str, str] = {}
        for error in events.failed:
            for transfer_id in error.transfer_ids:
                if transfer_id in by_transfer:
                    failed[by_transfer[transfer_id]] = str(error)
        return failed

    def _admit(self, request_ids: list[str]) -> tuple[list[KVArrival], list[str]]:
        """Ready on rank 0; ready everywhere? Returns (admitted, failed on another rank)."""
        if not request_ids:
            return [], []
        if self.tp.size > 1:  # every rank must hold its shard before the request runs
            transfers = [[self._incoming[r].descriptor.transfer_id.hex(),
                          self._incoming[r].descriptor.deadline] for r in request_ids]
            publish(self.tp, "admit", {"transfers": transfers})
            votes = self.tp.all_reduce_host(torch.zeros(len(request_ids), dtype=torch.int64))
        else:
            votes = torch.zeros(len(request_ids), dtype=torch.int64)
        admitted, lost = [], []
        for rid, bad in zip(request_ids, votes.tolist()):
            if bad:
                lost.append(rid)
                continue
            incoming = self._incoming.pop(rid)
            admitted.append(KVArrival(rid, incoming.first_token, incoming.logprobs))
        return admitted, lost

    def _cancel(self, request_id: str, reason: str) -> None:
        """Give the transfer up on every rank; its blocks are the engine's again."""
        transfer_id = self._incoming.pop(request_id).descriptor.transfer_id
        self._receiver().cancel(transfer_id, reason)
        if self.tp.size > 1:
            publish(self.tp, "cancel", {"transfer": transfer_id.hex(), "reason": reason})

    def _receiver(self) -> KVReceiver:
        assert self.receiver is not None, "register_kv_caches comes first"
        return self.receiver


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


def follower_handlers(receiver: KVReceiver, tp: TensorParallel) -> dict[str, Handler]:
    """A TP rank other than 0: what it does with rank 0's transfer messages."""

    def expect(body: dict[str, Any]) -> None:
        receiver.expect(TransferDescriptor.decode(body["descriptor"]))

    def admit(body: dict[str, Any]) -> None:
        tp.all_reduce_host(admission_votes(receiver, body))

    def cancel(body: dict[str, Any]) -> None:
        receiver.cancel(bytes.fromhex(body["transfer"]), body.get("reason", "cancelled"))

    return {"expect": expect, "admit": admit, "cancel": cancel}
