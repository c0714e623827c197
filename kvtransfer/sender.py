"""`KVSender`: a prefill rank's side of KV transfers — plan, pack, push layer by layer.

    plans = sender.plan([(descriptor, src_block_ids), ...])   # one per destination rank
    for layer in range(num_layers):
        ...compute layer...
        handles += [sender.push_layer(layer, p) for p in plans]  # returns at once
    for h in handles: h.wait()                                  # TransferError on failure
    for p in plans: sender.finish(p).wait()                     # DONE: receiver checks coverage
    # on a prefill failure instead: sender.abort(plans, ErrorCode.PREFILL_FAILED)

A plan is one message stream: every request of the batch whose KV heads go to the same
destination rank, so each layer is ONE message (one header; its payload in one of the two
forms of kvtransfer.header) per destination rank (at most MAX_TRANSFERS requests per plan;
bigger batches get several plans). `push_layer` gathers what is not already contiguous on the
calling thread and posts the sends; the bytes move in gloo's/NCCL's own threads while the
caller computes the next layer.

Ownership rule for the worker: the source blocks of a plan must not be freed or overwritten
until every handle of the plan was waited (runs of consecutive blocks are sent straight from
the cache), and every handle must be waited once (it holds the posted buffers).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kernels.backend import get_backend
from pdserve.kvtransfer.channel import Op, PairChannel
from pdserve.kvtransfer.connector import Connector
from pdserve.kvtransfer.descriptor import Endpoint, TransferDescriptor
from pdserve.kvtransfer.device_groups import check_transport_device
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.header import MAX_TRANSFERS, Kind, MessageHeader, TransferSlice
from pdserve.kvtransfer.layout import KVLayout, check_kv_caches, routes_from
from pdserve.kvtransfer.staging import BufferPool

logger = logging.getLogger(__name__)

ABORT_WAIT_S = 2.0
# Up to this many requests per message use the segmented format (two sends per request, each
# possibly zero-copy); more use one packed send (fewer, larger messages).
MAX_SEGMENTED_SLICES = 8


@dataclass(frozen=True)
class PushPlan:
    """The blocks of several requests, one head range, one destination rank, every layer."""

    destination: Endpoint
    head_start: int  # global KV heads
    head_end: int
    slices: tuple[TransferSlice, ...]  # destination block ranges, in payload order
    src_block_ids: tuple[int, ...]  # this rank's blocks, concatenated in slice order
    layout_id: bytes
    deadline: float  # the earliest deadline of its transfers
    group_id: int

    @property
    def transfer_ids(self) -> tuple[bytes, ...]:
        return tuple(s.transfer_id for s in self.slices)

    def source_blocks(self) -> list[tuple[int, ...]]:
        """This rank's block ids of each slice."""
        out, pos = [], 0
        for s in self.slices:
            out.append(self.src_block_ids[pos:pos + s.num_blocks])
            pos += s.num_blocks
        return out


class PushHandle:
    """One posted message; `wait()` returns when its bytes left, or raises TransferError."""

    def __init__(self, channel: PairChannel, ops: list[Op], plan: PushPlan,
                 pool: BufferPool | None = None, pooled: Sequence[torch.Tensor] = ()) -> None:
        self._channel, self._ops, self.plan = channel, ops, plan
        self._pool, self._pooled = pool, list(pooled)
        self._error: TransferError | None = None
        self.done = False

    def wait(self) -> None:
        if not self.done and self._error is None:
            try:
                for op in self._ops:
                    # A closed channel sends nothing more; don't sit out a send gloo can't wake.
                    self._channel.raise_if_closed()
                    self._channel.wait(op, self.plan.deadline)
                self.done = True
                for buf in self._pooled if self._pool is not None else ():
                    self._pool.give(buf)  # sent: the buffer is free again
            except TransferError as e:
                self._error = e.for_transfers(self.plan.transfer_ids)
            self._ops, self._pooled = [], []
        if self._error is not None:
            raise self._error


class KVSender:
    """Pushes this prefill rank's KV-head shard of `kv_caches` ([(k, v)] per layer)."""

    def __init__(
        self, layout: KVLayout, connector: Connector, source_tp: int,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, backend: object = None,
        pool: BufferPool | None = None,
    ) -> None:
        self.layout, self.source, self.source_tp = layout, connector.source, source_tp
        self.head_start, self.head_end = layout.head_ranges(source_tp)[self.source.rank]
        self.device = check_kv_caches(layout, kv_caches, self.head_end - self.head_start)
        check_transport_device(connector.device, self.device, "KVSender")
        self.kv_caches = kv_caches
        self._ops = backend or get_backend(self.device)
        self._connector = connector
        self._pool = pool or BufferPool()
        self._contiguous = all(k.is_contiguous() and v.is_contiguous() for k, v in kv_caches)
        self._group_ids = itertools.count(1)
        self.sent_nbytes = 0  # KV payload bytes handed to the transport, every layer and plan

    def plan(
        self, transfers: Sequence[tuple[TransferDescriptor, Sequence[int]]],
        block_offsets: Sequence[int] | None = None,
    ) -> list[PushPlan]:
        """Group a batch by destination rank. `transfers[i]` = (descriptor, this rank's block
        ids of that request from the descriptor's first_block on); `block_offsets[i]` = index
        of its first block in the reservation (chunked prefill pushes a request in pieces)."""
        offsets = block_offsets or [0] * len(transfers)
        groups: dict[tuple, list[tuple[TransferDescriptor, Sequence[int], int]]] = {}
        for (desc, src), offset in zip(transfers, offsets, strict=True):
            self._check(desc, src, offset)
            for route in routes_from(self.layout, self.source.rank, self.source_tp,
                                     len(desc.destinations)):
                dest = desc.destinations[route.dest_rank].endpoint
                key = (dest, route.head_start, route.head_end, desc.layout_id)
                groups.setdefault(key, []).append((desc, src, offset))
        plans = []
        for (dest, h0, h1, layout_id), members in groups.items():
            for i in range(0, len(members), MAX_TRANSFERS):
                chunk = members[i:i + MAX_TRANSFERS]
                plans.append(PushPlan(
                    dest, h0, h1,
                    tuple(TransferSlice(d.transfer_id, off, len(src)) for d, src, off in chunk),
                    tuple(int(b) for _, src, _ in chunk for b in src), layout_id,
                    min(d.deadline for d, _, _ in chunk), next(self._group_ids)))
        return plans

    def push_layer(self, layer: int, plan: PushPlan) -> PushHandle:
        """Post this layer's blocks of `plan`; returns without waiting. The source blocks
        must not change until the handle is waited (runs of consecutive blocks are sent
        straight from the cache)."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer must be in [0, {self.layout.num_layers}), got {layer}")
        channel = self._channel(plan)
        segmented = len(plan.slices) <= MAX_SEGMENTED_SLICES
        with torch.inference_mode():
            parts, pooled = (self._segments if segmented else self._packed)(layer, plan)
        header = MessageHeader.for_layer(self.layout, plan.group_id, layer, plan.head_start,
                                         plan.head_end, plan.slices, plan.deadline, segmented)
        return self._post(channel, header, parts, plan, pooled)

    def _packed(self, layer: int, plan: PushPlan) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One [2, n, ...] buffer with every block of the plan (kernels.reference.pack_blocks)."""
        buf = self._gather(layer, plan, plan.src_block_ids)
        return [buf], [buf] if self.device.type != "cuda" else []

    def _segments(self, layer: int, plan: PushPlan) -> tuple[list[torch.Tensor],
                                                             list[torch.Tensor]]:
        """K then V of each slice: views of the cache where the blocks are consecutive and
        cover this rank's whole head range, gathered copies elsewhere."""
        k, v = self.kv_caches[layer]
        whole = (plan.head_start, plan.head_end) == (self.head_start, self.head_end)
        parts, pooled = [], []
        for ids in plan.source_blocks():
            if whole and self._contiguous and ids[-1] - ids[0] == len(ids) - 1 and all(
                    b == ids[0] + i for i, b in enumerate(ids)):
                parts += [k[ids[0]:ids[0] + len(ids)], v[ids[0]:ids[0] + len(ids)]]
                continue
            buf = self._gather(layer, plan, ids)
            parts += [buf[0], buf[1]]
            pooled += [buf] if self.device.type != "cuda" else []
        return parts, pooled

    def _gather(self, layer: int, plan: PushPlan, ids: Sequence[int]) -> torch.Tensor:
        k, v = self.kv_caches[layer]
        src = torch.tensor(ids, dtype=torch.int64, device=self.device)
        h0, h1 = plan.head_start - self.head_start, plan.head_end - self.head_start
        out = None
        if self.device.type != "cuda":  # CUDA's caching allocator recycles memory already
            shape = (2, len(ids), self.layout.block_size, h1 - h0, self.layout.head_dim)
            out = self._pool.take(shape, k.dtype, self.device)
        return self._ops.pack_blocks(k, v, src, h0, h1, out=out)

    def finish(self, plan: PushPlan) -> PushHandle:
        """Tell the receiver this rank pushed everything for `plan` (it checks nothing is
        missing, so a sender bug fails fast instead of at the deadline)."""
        header = MessageHeader.for_control(self.layout, Kind.DONE, ErrorCode.NONE, plan.group_id,
                                           plan.head_start, plan.head_end, plan.transfer_ids,
                                           plan.deadline)
        return self._post(self._channel(plan), header, [], plan)

    def abort(self, plans: Sequence[PushPlan], code: ErrorCode = ErrorCode.PREFILL_FAILED) -> None:
        """Best effort: tell each destination to fail these transfers now. Never raises."""
        for plan in plans:
            try:
                header = MessageHeader.for_control(
                    self.layout, Kind.ERROR, code, plan.group_id, plan.head_start, plan.head_end,
                    plan.transfer_ids, max(plan.deadline, time.time() + ABORT_WAIT_S))
                channel = self._connector.connect(plan.destination, self.layout)
                _, ops = channel.post_message(header, self.layout)
                channel.wait(ops[0], time.time() + ABORT_WAIT_S)
            except (TransferError, ValueError) as e:
                logger.warning("could not tell %s to abort %d transfers: %s",
                               plan.destination.key, len(plan.slices), e)

    def close(self) -> None:
        self._connector.close()

    def _check(self, desc: TransferDescriptor, src: Sequence[int], offset: int) -> None:
        if len(desc.sources) != self.source_tp or desc.sources[self.source.rank] != self.source:
            raise ValueError(f"descriptor of {desc.request_id!r} names sources "
                             f"{[s.key for s in desc.sources]}; this sender is "
                             f"{self.source.key} of a TP={self.source_tp} group")
        if not src or offset < 0 or offset + len(src) > desc.num_pushed_blocks:
            raise ValueError(f"blocks [{offset}, {offset + len(src)}) of {desc.request_id!r} "
                             f"don't fit the {desc.num_pushed_blocks} blocks it reserved to "
                             f"receive (after the {desc.first_block} the decode side holds)")
        num_blocks = self.kv_caches[0][0].shape[0]
        if any(not 0 <= int(b) < num_blocks for b in src):
            raise ValueError(f"source block ids of {desc.request_id!r} must be in "
                             f"[0, {num_blocks})")

    def _channel(self, plan: PushPlan) -> PairChannel:
        if time.time() >= plan.deadline:
            raise TransferError("deadline passed before the push", ErrorCode.DEADLINE,
                                plan.transfer_ids)
        try:  # the handshake compares layouts: a mismatch fails here, and on the receiver
            channel = self._connector.connect(plan.destination, self.layout)
        except TransferError as e:
            raise e.for_transfers(plan.transfer_ids) from None
        if plan.layout_id != self.layout.layout_id:
            self.abort([plan], ErrorCode.LAYOUT_MISMATCH)
            raise TransferError(f"descriptors carry layout id {plan.layout_id.hex()}, this "
                                f"sender's is {self.layout.layout_id.hex()} ({self.layout})",
                                ErrorCode.LAYOUT_MISMATCH, plan.transfer_ids)
        return channel

    def _post(self, channel: PairChannel, header: MessageHeader, parts: list[torch.Tensor],
              plan: PushPlan, pooled: Sequence[torch.Tensor] = ()) -> PushHandle:
        try:
            _, ops = channel.post_message(header, self.layout, parts)
        except TransferError as e:
            raise e.for_transfers(plan.transfer_ids) from None
        self.sent_nbytes += sum(p.numel() * p.element_size() for p in parts)
        return PushHandle(channel, ops, plan, self._pool, pooled)
