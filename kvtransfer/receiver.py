"""`KVReceiver`: a decode rank's side of KV transfers — reserve, receive, validate, unpack.

    receiver = KVReceiver(layout, GlooListener(host, rank=r), dest_tp, runner.kv_caches)
    receiver.expect(descriptor)        # when the blocks are reserved, before prefill starts
    events = receiver.poll()           # each engine step: .completed ids, .failed errors
    receiver.cancel(transfer_id)       # client gone: blocks are the worker's when it returns

Ownership rule for the worker: a transfer's blocks belong to the transfer from `expect()`
until `poll()` or `wait()` reported it (completed or failed) or `cancel()` returned; then
they are the worker's again and nothing writes into them any more. That includes data
received straight into the blocks (kvtransfer.landing): a failure is reported only once no
such write is in flight, and cancel() waits for one.

Every accepted channel gets a `ChannelReader` (kvtransfer.inbox) that validates each header
against the layout and the reservations *before* posting any payload recv (a refused message
moves no KV bytes), then lands the payload. Deadlines are enforced by whoever looks first:
`wait`, `poll`, or the landing of a late message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kvtransfer.channel import PairChannel
from pdserve.kvtransfer.connector import Listener
from pdserve.kvtransfer.descriptor import Endpoint, TransferDescriptor
from pdserve.kvtransfer.device_groups import check_transport_device
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.header import DEFAULT_MAX_PAYLOAD_NBYTES, Kind, MessageHeader
from pdserve.kvtransfer.inbox import ChannelReader
from pdserve.kvtransfer.landing import Delivery, Landing
from pdserve.kvtransfer.layout import KVLayout, check_kv_caches
from pdserve.kvtransfer.reservation import Reservation, TransferState

logger = logging.getLogger(__name__)

TOMBSTONE_S = 30.0  # finished transfers are remembered this long past their deadline
CANCEL_DRAIN_S = 2.0


@dataclass(frozen=True)
class ReceiverEvents:
    """What changed since the last poll: transfers now complete, and transfers that failed."""

    completed: tuple[bytes, ...]
    failed: tuple[TransferError, ...]  # each names its transfer in .transfer_ids


class KVReceiver:
    """Receives KV for this decode rank's head shard into `kv_caches` ([(k, v)] per layer)."""

    def __init__(
        self, layout: KVLayout, listener: Listener, dest_tp: int,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, backend: object = None,
        max_payload_nbytes: int = DEFAULT_MAX_PAYLOAD_NBYTES, max_inflight: int = 8,
    ) -> None:
        self.layout, self.endpoint = layout, listener.endpoint
        self.head_start, self.head_end = layout.head_ranges(dest_tp)[self.endpoint.rank]
        self.device = check_kv_caches(layout, kv_caches, self.head_end - self.head_start)
        check_transport_device(listener.device, self.device, "KVReceiver")
        self.landing = Landing(layout, kv_caches, (self.head_start, self.head_end), backend,
                               max_payload_nbytes, max_inflight)
        self._listener = listener
        self._cond = threading.Condition()
        self._transfers: dict[bytes, Reservation] = {}
        self._readers: dict[str, ChannelReader] = {}  # the current channel per sender
        self._started: list[ChannelReader] = []  # every reader, joined on close
        self._closed = False
        listener.listen(self._accept, self._on_channel)

    # ---- the decode worker's API ----

    def expect(self, descriptor: TransferDescriptor) -> None:
        """Register a reservation; raises ValueError if it is not for this rank and layout."""
        descriptor.check_layout(self.layout)
        if self.endpoint.rank >= len(descriptor.destinations):
            raise ValueError(f"descriptor has {len(descriptor.destinations)} destination "
                             f"ranks, this receiver is rank {self.endpoint.rank}")
        shard = descriptor.destinations[self.endpoint.rank]
        if shard.endpoint != self.endpoint:
            raise ValueError(f"descriptor sends rank {self.endpoint.rank}'s shard to "
                             f"{shard.endpoint.key}, this receiver is {self.endpoint.key}")
        if (shard.head_start, shard.head_end) != (self.head_start, self.head_end):
            raise ValueError(f"descriptor gives this rank heads [{shard.head_start}, "
                             f"{shard.head_end}), it holds [{self.head_start}, {self.head_end})")
        if max(shard.block_ids) >= self.landing.num_blocks:
            raise ValueError(f"block id {max(shard.block_ids)} is past the cache's "
                             f"{self.landing.num_blocks} blocks")
        dst = torch.tensor(shard.block_ids, dtype=torch.int64, device=self.device)
        with self._cond:
            if self._closed:
                raise TransferError("receiver is closed", ErrorCode.SHUTDOWN)
            self._purge()
            if descriptor.transfer_id in self._transfers:
                raise ValueError(f"transfer id {descriptor.transfer_id.hex()} is already in "
                                 "use: every request needs a fresh TransferDescriptor.new()")
            self._transfers[descriptor.transfer_id] = Reservation(
                descriptor, shard.block_ids, dst, self.head_start, self.head_end,
                self.layout.num_layers)

    def wait(self, transfer_id: bytes, timeout: float | None = None) -> bool:
        """True once complete; TransferError once failed (deadline, cancel, peer lost...):
        either way the blocks are the caller's again. False if `timeout` s passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            res = self._get(transfer_id)
            while res.state is not TransferState.DONE and not res.settled:
                if res.state is TransferState.PENDING and res.expired:
                    self._fail(res, self._deadline_error(res))
                    continue
                left = max(res.deadline - time.time(), 0.0) if (
                    res.state is TransferState.PENDING) else 0.05
                if end is not None:
                    if time.monotonic() >= end:
                        return False
                    left = min(left, end - time.monotonic())
                self._cond.wait(left + 0.001)
            res.reported = True
            if res.error is not None:
                raise res.error
            return True

    def poll(self) -> ReceiverEvents:
        """Transfers completed or failed (deadlines included) since the last poll.

        A transfer's blocks may be freed (or reused) once it was reported here or by wait().
        """
        completed, failed = [], []
        with self._cond:
            for res in self._transfers.values():
                if res.state is TransferState.PENDING and res.expired:
                    self._fail(res, self._deadline_error(res))
                if res.reported or not (res.state is TransferState.DONE or res.settled):
                    continue
                res.reported = True
                if res.error is None:
                    completed.append(res.transfer_id)
                else:
                    failed.append(res.error)
            self._purge()
        return ReceiverEvents(tuple(completed), tuple(failed))

    def cancel(self, transfer_id: bytes, reason: str = "cancelled by the decode worker") -> None:
        """Give a transfer up; once this returns nothing writes into its blocks again.

        Usually immediate. If a payload is being received straight into its blocks right now,
        this waits for it (typically ~1 ms a layer); one still stalled after CANCEL_DRAIN_S
        gets its channel closed (gloo writes nothing more after a close, kvtransfer.channel
        finding 5), failing that channel's other transfers too.
        """
        with self._cond:
            res = self._transfers.get(transfer_id)
            if res is None:
                return
            if res.state is TransferState.PENDING:
                self._fail(res, TransferError(reason, ErrorCode.CANCELLED))
            res.reported = True
            if self._cond.wait_for(lambda: res.inflight == 0, CANCEL_DRAIN_S):
                return
            stalled = [r.channel for r in self._started if r.channel.name in res.channels]
        for channel in stalled:
            channel.close(f"a cancelled transfer's payload stalled for {CANCEL_DRAIN_S} s",
                          ErrorCode.PROTOCOL)
        with self._cond:
            if not self._cond.wait_for(lambda: res.inflight == 0, CANCEL_DRAIN_S):
                logger.error("transfer %s: direct writes still pending after its channel "
                             "closed", transfer_id.hex())

    def pending(self) -> int:
        with self._cond:
            return sum(r.state is TransferState.PENDING for r in self._transfers.values())

    def close(self) -> None:
        """Stop listening, close every channel, fail what is pending (SHUTDOWN)."""
        with self._cond:
            self._closed = True
            readers, self._started = self._started, []
            self._readers.clear()
        self._listener.close()
        for reader in readers:
            reader.channel.close("receiver shut down", ErrorCode.SHUTDOWN)
        for reader in readers:
            reader.join()
        with self._cond:
            for res in self._transfers.values():
                if res.state is TransferState.PENDING:
                    self._fail(res, TransferError("receiver shut down", ErrorCode.SHUTDOWN))

    # ---- called by the listener and the channel readers ----

    def _accept(self, source: Endpoint, layout: KVLayout) -> tuple[ErrorCode, str] | None:
        if layout == self.layout:
            return None
        reason = (f"layout mismatch between sender {source.key} and receiver "
                  f"{self.endpoint.key}: {self.layout.describe_difference(layout)} (receiver "
                  f"vs sender); no KV was moved")
        with self._cond:
            for res in self._transfers.values():
                if res.state is TransferState.PENDING and source.key in res.source_keys:
                    self._fail(res, TransferError(reason, ErrorCode.LAYOUT_MISMATCH))
        return ErrorCode.LAYOUT_MISMATCH, reason

    def _on_channel(self, source: Endpoint, channel: PairChannel) -> None:
        reader = ChannelReader(self, source, channel, self.layout,
                               self.landing.max_payload_nbytes, self.landing.max_inflight)
        with self._cond:
            if self._closed:
                channel.close("receiver shut down", ErrorCode.SHUTDOWN)
                return
            old = self._readers.get(source.key)
            self._readers[source.key] = reader
            self._started = [r for r in self._started if r.alive] + [reader]
        if old is not None:
            old.channel.close("replaced by a newer channel from the same sender",
                              ErrorCode.PEER_LOST)
        reader.start()

    def channel_lost(self, source: Endpoint, channel: PairChannel, error: TransferError) -> None:
        """Fail what this channel carried, and what its sender still owed if it was current."""
        with self._cond:
            current = self._readers.get(source.key)
            is_current = current is None or current.channel is channel
            if is_current and current is not None:
                del self._readers[source.key]
            for res in self._transfers.values():
                if res.state is TransferState.PENDING and source.key in res.source_keys and (
                        is_current or channel.name in res.channels):
                    self._fail(res, error)

    def claim(self, source: Endpoint, channel: PairChannel, header: MessageHeader) -> Delivery:
        """Claim the wanted slices of a LAYER header; the channel then posts the recvs."""
        with self._cond:
            return self.landing.claim(self._transfers, source, channel.name, header, self._fail)

    def release(self, delivery: Delivery) -> None:
        """A delivery's recvs failed: its claims are no longer in flight."""
        with self._cond:
            self.landing.release(delivery)
            self._cond.notify_all()

    def land(self, source: Endpoint, channel: PairChannel, delivery: Delivery) -> None:
        """Apply one received message: unpack what is still wanted, settle DONE/ERROR."""
        with self._cond:
            if delivery.header.kind is Kind.LAYER:
                for res in self.landing.land(delivery):
                    if res.state is TransferState.PENDING and res.complete:
                        res.state = TransferState.DONE
                        logger.debug("transfer %s complete", res.transfer_id.hex())
            else:
                self._settle(source, delivery.header)
            self._cond.notify_all()
        self.landing.recycle(delivery)

    def _settle(self, source: Endpoint, header: MessageHeader) -> None:
        for s in header.transfers:
            res = self._transfers.get(s.transfer_id)
            if res is None or res.state is not TransferState.PENDING or (
                    source.key not in res.source_keys):
                continue
            if header.kind is Kind.ERROR:
                self._fail(res, TransferError(f"sender {source.key} gave the transfer up",
                                              header.code))
            elif (missing := res.missing(header.head_start, header.head_end)) > 0:
                self._fail(res, TransferError(f"sender {source.key} finished with {missing} "
                                              "(layer, head, block) cells never sent"))

    def _fail(self, res: Reservation, error: TransferError) -> None:
        if res.state is TransferState.PENDING:
            res.state, res.error = TransferState.FAILED, error.for_transfers([res.transfer_id])
            logger.warning("transfer %s (%s) failed: %s", res.transfer_id.hex(),
                           res.descriptor.request_id, error)
            self._cond.notify_all()

    @staticmethod
    def _deadline_error(res: Reservation) -> TransferError:
        return TransferError(f"transfer of {res.descriptor.request_id!r} expired: its deadline "
                             "passed before all of its KV landed", ErrorCode.DEADLINE)

    def _get(self, transfer_id: bytes) -> Reservation:
        res = self._transfers.get(transfer_id)
        if res is None:
            raise ValueError(f"unknown transfer id {transfer_id.hex()}: expect() it first")
        return res

    def _purge(self) -> None:
        cutoff = time.time() - TOMBSTONE_S
        for tid in [t for t, r in self._transfers.items()
                    if r.reported and r.deadline < cutoff]:
            del self._transfers[tid]
