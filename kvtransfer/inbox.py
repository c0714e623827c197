"""The receiving half of a channel: read headers, post payload recvs, land the bytes.

`ChannelReader` runs two threads per accepted channel:

    reader    keeps HEADERS_POSTED header recvs posted on the control group (so a recv is
              always posted there: that is how a dead sender is noticed within ~50 ms even
              while a payload streams, see kvtransfer.channel); for each header in turn it
              validates it, claims its wanted slices and posts its payload recvs
              (kvtransfer.landing)
    lander    waits for message k's payload (bounded: PAYLOAD_STALL_S), then hands it to
              its owner's `land` (KVReceiver), which unpacks what was staged under its lock

so payload k+1 streams while payload k lands. A header that fails validation, or names a
transfer not reserved here (kvtransfer.landing), closes the channel before any payload
buffer is allocated or recv posted: no byte of that payload moves.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from pdserve.kvtransfer.channel import PairChannel
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.header import HeaderError, Kind, LayoutMismatchError, MessageHeader, decode
from pdserve.kvtransfer.landing import Delivery
from pdserve.kvtransfer.layout import KVLayout

logger = logging.getLogger(__name__)

PAYLOAD_GRACE_S = 1.0  # clock skew allowance before a late payload closes the channel
# A payload streams right behind its header, so one that takes longer than this is stalled.
# The bound matters because gloo cannot interrupt a recv whose peer died mid-stream
# (kvtransfer.channel finding 1): the transfer fails at once through the control group, but
# the lander thread, its buffers and its claims are released only when this wait runs out.
PAYLOAD_STALL_S = 10.0
MIN_BYTES_PER_S = 50e6
DRAIN_WAIT_S = 0.1  # after a failure, how long each queued recv may take to report closed
JOIN_S = 2.0
HEADERS_POSTED = 8


class ChannelOwner(Protocol):
    """What a reader needs from whoever owns the reservations (the KVReceiver)."""

    def claim(self, source: Endpoint, channel: PairChannel, header: MessageHeader) -> Delivery:
        """Claim the wanted slices of a LAYER header; the reader then posts the recvs."""

    def release(self, delivery: Delivery) -> None:
        """A delivery's recvs failed: its claims are no longer in flight."""

    def land(self, source: Endpoint, channel: PairChannel, delivery: Delivery) -> None:
        """Apply one received message."""

    def channel_lost(self, source: Endpoint, channel: PairChannel, error: TransferError) -> None:
        """The channel closed: fail what it carried."""


class ChannelReader:
    def __init__(
        self, owner: ChannelOwner, source: Endpoint, channel: PairChannel, layout: KVLayout,
        max_payload_nbytes: int, max_inflight: int,
    ) -> None:
        self.owner, self.source, self.channel = owner, source, channel
        self.layout = layout
        self.max_payload_nbytes = max_payload_nbytes
        self._queue: queue.Queue = queue.Queue(maxsize=max_inflight)
        self._drained = False  # the lander saw the reader's end-of-stream None
        self._deliveries: dict[int, Delivery] = {}  # posted, not yet landed or abandoned
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._guard, args=(self._read,), daemon=True,
                             name=f"kv-read-{source.key}"),
            threading.Thread(target=self._guard, args=(self._land,), daemon=True,
                             name=f"kv-land-{source.key}"),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def join(self) -> None:
        for t in self._threads:
            t.join(JOIN_S)
            if t.is_alive():  # see PAYLOAD_STALL_S
                logger.info("%s still waits on a payload from a lost peer; it ends by itself",
                            t.name)

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except TransferError as e:  # the channel is closed: nothing lands any more
            self._release_all()
            self.owner.channel_lost(self.source, self.channel, e)
        except Exception as e:  # a bug here must fail transfers, not hang them
            logger.exception("channel %s reader crashed", self.channel.name)
            self.channel.close(f"receiver error: {type(e).__name__}: {e}", ErrorCode.PROTOCOL)
            self._release_all()
            self.owner.channel_lost(self.source, self.channel, TransferError(
                f"receiver error: {e}", ErrorCode.PROTOCOL))
        finally:
            if loop == self._read:
                self._queue.put(None)
            elif not self._drained:  # the reader may be blocked on a full queue: unblock it
                while (delivery := self._queue.get()) is not None:
                    self._abandon(delivery)

    def _read(self) -> None:
        # Several header recvs stay posted (FIFO on one tag): a header then moves as soon as
        # it is sent instead of after a recv-ready round trip with this thread, which on a
        # busy host has to be scheduled first (measured: ~0.6 -> ~0.85 of raw gloo).
        posted = collections.deque(self.channel.post_header_recv()
                                   for _ in range(HEADERS_POSTED))
        seq = 0
        while True:
            op = posted.popleft()
            self.channel.wait(op, None)
            raw = op.tensor.numpy().tobytes()
            posted.append(self.channel.post_header_recv())
            header = self._validate(raw, seq)
            seq += 1
            if header.kind is not Kind.LAYER:
                self._queue.put(Delivery(header))
                continue
            try:  # entries must match reservations before a single buffer is allocated
                delivery = self.owner.claim(self.source, self.channel, header)
            except HeaderError as e:
                raise self._refuse(e) from None
            with self._lock:
                self._deliveries[id(delivery)] = delivery
            try:
                delivery.ops = [self.channel.post_payload_recv(t, header.seq)
                                for t in delivery.targets]
            except TransferError:
                self._done(delivery)
                raise
            self._queue.put(delivery)

    def _validate(self, raw: bytes, seq: int) -> MessageHeader:
        try:
            header = decode(raw, self.layout, self.max_payload_nbytes)
            if header.seq != seq:
                raise HeaderError(f"header seq {header.seq}, expected {seq}: a message was lost")
            return header
        except HeaderError as e:
            raise self._refuse(e) from None

    def _refuse(self, error: HeaderError) -> TransferError:
        """Close the channel (no byte of the refused message moves) and say why."""
        code = ErrorCode.LAYOUT_MISMATCH if isinstance(error, LayoutMismatchError) else (
            ErrorCode.PROTOCOL)
        self.channel.close(f"receiver refused a header: {error}", code)
        return TransferError(f"{self.source.key} sent a bad header: {error}", code)

    def _land(self) -> None:
        while (delivery := self._queue.get()) is not None:
            header = delivery.header
            stall = PAYLOAD_STALL_S + header.payload_nbytes / MIN_BYTES_PER_S
            deadline = min(header.deadline + PAYLOAD_GRACE_S, time.time() + stall)
            try:
                while delivery.waited < len(delivery.ops):
                    delivery.waited += 1
                    self.channel.wait(delivery.ops[delivery.waited - 1], deadline)
            except TransferError:
                self._abandon(delivery)
                raise
            self.owner.land(self.source, self.channel, delivery)
            self._done(delivery)
        self._drained = True

    def _abandon(self, delivery: Delivery) -> None:
        """The channel failed: let every posted recv report closed, then drop the claims."""
        for op in delivery.ops[delivery.waited:]:
            with contextlib.suppress(TransferError):
                self.channel.wait(op, time.time() + DRAIN_WAIT_S)
        delivery.waited = len(delivery.ops)
        self._done(delivery)

    def _done(self, delivery: Delivery) -> None:
        with self._lock:
            self._deliveries.pop(id(delivery), None)
        self.owner.release(delivery)

    def _release_all(self) -> None:
        """After the channel closed: every posted recv is dead, release their claims now
        rather than when a stuck wait runs out (see Landing.release)."""
        with self._lock:
            deliveries = list(self._deliveries.values())
        for delivery in deliveries:
            self.owner.release(delivery)
