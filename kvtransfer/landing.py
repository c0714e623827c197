"""Where a LAYER message's bytes go on the receiver: claimed slices, recv targets, unpacking.

For each accepted header the receiver *claims* the slices it still wants (validated against
the reservations) and builds the recv targets, in wire order:

    packed     one pooled staging buffer for the whole message, unpacked slice by slice
    segmented  per entry, K then V: straight into the cache blocks when the entry covers
               this rank's whole head range and its destination blocks are consecutive
               (`direct`: no copy at all), else a pooled staging buffer that is unpacked

Every entry must name a transfer reserved here, from this sender, within the reserved heads
and blocks, or the whole message is refused before anything is claimed or allocated (the
channel closes): a peer can't make the receiver allocate staging beyond its reservations.
Entries no longer wanted (cancelled, failed, a duplicate) are received into staging and
dropped, so the stream stays aligned without touching the cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kernels.backend import get_backend
from pdserve.kvtransfer.channel import Op
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.header import HeaderError, MessageHeader, TransferSlice
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.reservation import Reservation, TransferState
from pdserve.kvtransfer.staging import BufferPool

logger = logging.getLogger(__name__)

FailFn = Callable[[Reservation, TransferError], None]


@dataclass
class Part:
    """One claimed entry of a LAYER message."""

    res: Reservation
    entry: TransferSlice
    index: int  # entry index in the header
    position: int  # first block of the entry in the message's block order
    direct: bool  # received straight into the cache blocks


@dataclass
class Delivery:
    """A message between its header and its landing: claims, targets, posted recvs."""

    header: MessageHeader
    parts: list[Part] = field(default_factory=list)
    targets: list[torch.Tensor] = field(default_factory=list)  # recv targets, wire order
    staged: dict[int, torch.Tensor] = field(default_factory=dict)  # entry index -> staging
    ops: list[Op] = field(default_factory=list)
    waited: int = 0  # ops waited so far (each Op is waited exactly once)
    released: bool = False  # claims dropped: landed, or its channel closed


class Landing:
    """Staging buffers, claims and unpacking for one receiver's caches."""

    def __init__(
        self, layout: KVLayout, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        head_range: tuple[int, int], backend: Any, max_payload_nbytes: int, max_inflight: int,
    ) -> None:
        self.layout, self.kv_caches = layout, kv_caches
        self.head_start, self.head_end = head_range
        self.device = kv_caches[0][0].device
        self.ops = backend or get_backend(self.device)
        self.num_blocks = kv_caches[0][0].shape[0]
        self.max_payload_nbytes, self.max_inflight = max_payload_nbytes, max_inflight
        self.pool = BufferPool()
        self._direct_ok = all(k.is_contiguous() and v.is_contiguous() for k, v in kv_caches)

    def claim(
        self, transfers: dict[bytes, Reservation], source: Endpoint, channel: str,
        header: MessageHeader, fail: FailFn,
    ) -> Delivery:
        """Claim the wanted entries of a LAYER header (arriving on `channel`) and build its
        recv targets. A transfer with a claim on a channel fails if that channel is lost.
        Raises HeaderError, with nothing claimed or allocated, if any entry is not reserved."""
        why = self.refusal(transfers, source, header)
        if why is not None:
            raise HeaderError(f"refused before receiving: {why}")
        delivery, position = Delivery(header), 0
        full = (header.head_start, header.head_end) == (self.head_start, self.head_end)
        for index, entry in enumerate(header.transfers):
            res = self._wanted(transfers, source, header, entry, fail)
            if res is not None:
                direct = (header.segmented and full and self._direct_ok
                          and res.consecutive(entry.block_offset, entry.num_blocks))
                res.claim(header.layer, header.head_start, header.head_end, entry.block_offset,
                          entry.num_blocks, direct)
                res.channels.add(channel)
                delivery.parts.append(Part(res, entry, index, position, direct))
            position += entry.num_blocks
        self._targets(delivery)
        return delivery

    @staticmethod
    def refusal(transfers: dict[bytes, Reservation], source: Endpoint,
                header: MessageHeader) -> str | None:
        """Why no byte of this message may be received, or None: an entry names a transfer
        not reserved here (pending or a tombstone), one `source` does not send, or cells
        outside its reservation. Checks sizes only: a header can't make us allocate more."""
        for index, entry in enumerate(header.transfers):
            res, tid = transfers.get(entry.transfer_id), entry.transfer_id.hex()
            if res is None:
                return f"entry {index} names transfer {tid}, which has no reservation here"
            if source.key not in res.source_keys:
                return f"entry {index}: {source.key} is not a source of transfer {tid}"
            why = res.fits(header.head_start, header.head_end, entry.block_offset,
                           entry.num_blocks)
            if why is not None:
                return f"entry {index} (transfer {tid}): {why}"
        return None

    def _wanted(
        self, transfers: dict[bytes, Reservation], source: Endpoint, header: MessageHeader,
        entry: TransferSlice, fail: FailFn,
    ) -> Reservation | None:
        res = transfers[entry.transfer_id]  # `refusal` checked it is there
        if res.state is not TransferState.PENDING:
            return None  # cancelled or failed: received into staging, dropped
        if res.expired:
            fail(res, TransferError(f"transfer of {res.descriptor.request_id!r} expired: a "
                                    "message for it came after its deadline", ErrorCode.DEADLINE))
            return None
        why = res.check_slice(header.layer, header.head_start, header.head_end,
                              entry.block_offset, entry.num_blocks)
        if why is not None:
            fail(res, TransferError(f"sender {source.key}: {why}", ErrorCode.PROTOCOL))
            return None
        return res

    def _targets(self, d: Delivery) -> None:
        h = d.header
        heads, lay = h.head_end - h.head_start, self.layout
        if not h.segmented:  # one packed [2, n, block_size, heads, head_dim] buffer
            shape = (2, h.num_blocks, lay.block_size, heads, lay.head_dim)
            d.staged[-1] = self.pool.take(shape, lay.torch_dtype, self.device)
            d.targets.append(d.staged[-1])
            return
        direct = {p.index: p for p in d.parts if p.direct}
        k, v = self.kv_caches[h.layer]
        for index, entry in enumerate(h.transfers):
            if index in direct:
                first = direct[index].res.block_ids[entry.block_offset]
                d.targets += [k[first:first + entry.num_blocks], v[first:first + entry.num_blocks]]
            else:
                shape = (2, entry.num_blocks, lay.block_size, heads, lay.head_dim)
                buf = d.staged[index] = self.pool.take(shape, lay.torch_dtype, self.device)
                d.targets += [buf[0], buf[1]]

    @torch.inference_mode()
    def land(self, d: Delivery) -> list[Reservation]:
        """Unpack the staged parts still wanted; release every claim. Returns the touched."""
        if d.released:  # its channel closed meanwhile: the transfers failed with it
            return []
        h = d.header
        live = [p for p in d.parts if p.res.state is TransferState.PENDING]
        k, v = self.kv_caches[h.layer] if live else (None, None)
        h0, h1 = h.head_start - self.head_start, h.head_end - self.head_start
        staged = [p for p in live if not p.direct]
        if staged and not h.segmented:
            payload, dst = d.staged[-1], self._dst(staged)
            if len(staged) < len(h.transfers):  # keep only the wanted blocks, in order
                idx = torch.cat([torch.arange(p.position, p.position + p.entry.num_blocks)
                                 for p in staged])
                payload = payload.index_select(1, idx.to(self.device))
            self.ops.unpack_blocks(payload, k, v, dst, h0, h1)
        for p in staged if h.segmented else ():
            self.ops.unpack_blocks(d.staged[p.index], k, v, self._dst([p]), h0, h1)
        if live and self.device.type == "cuda":  # complete means readable from any stream
            torch.cuda.current_stream(self.device).synchronize()
        for p in live:
            p.res.land(h.head_start, h.head_end, p.entry.num_blocks)
        touched = [p.res for p in d.parts]
        self.release(d)
        return touched

    def release(self, d: Delivery) -> None:
        """Drop the claims (idempotent). Safe for direct parts once the message landed or its
        channel was closed here: measured, a closed gloo pair writes no more bytes into a
        posted recv buffer, even one whose wait has not returned yet."""
        if d.released:
            return
        d.released = True
        for p in d.parts:
            if p.direct:
                p.res.release()

    def recycle(self, d: Delivery) -> None:
        """Staging buffers back to the pool (only after every op completed)."""
        for buf in d.staged.values():
            self.pool.give(buf)
        d.staged = {}

    @staticmethod
    def _dst(parts: list[Part]) -> torch.Tensor:
        return torch.cat([p.res.dst_ids[p.entry.block_offset:p.entry.block_offset
                                        + p.entry.num_blocks] for p in parts])
