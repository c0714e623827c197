"""`Reservation`: the receiver's record of one expected transfer, and what has landed.

A transfer is complete when every (layer, KV head of this rank, block) was written exactly
once, whichever source ranks sent which head sub-ranges (any prefill TP); a duplicate or an
out-of-range slice fails the transfer instead of overwriting KV.

A slice is *claimed* when its header is accepted (its cells can't be claimed twice) and
*landed* when its bytes are in the cache. A *direct* slice is received straight into the cache
blocks, so between the two the transport may be writing them: a failed or cancelled transfer
is only reported (and its blocks only become free) once no direct slice is in flight
(`settled`). Staged slices land by an unpack under the receiver's lock, which checks first.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pdserve.kvtransfer.descriptor import TransferDescriptor
from pdserve.kvtransfer.errors import TransferError


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass
class Reservation:
    descriptor: TransferDescriptor
    block_ids: tuple[int, ...]  # this rank's destination blocks
    dst_ids: torch.Tensor  # the same, [num_blocks] int64 on the cache device
    head_start: int  # this rank's global KV-head range
    head_end: int
    num_layers: int
    coverage: torch.Tensor = field(init=False)  # [num_layers, num_heads, num_blocks] bool
    received: int = 0  # cells landed
    inflight: int = 0  # direct slices whose bytes may still be arriving in the blocks
    state: TransferState = TransferState.PENDING
    error: TransferError | None = None
    reported: bool = False  # completion/failure handed to the caller (poll or wait)
    channels: set[str] = field(default_factory=set)  # channels it has claims on

    def __post_init__(self) -> None:
        shape = (self.num_layers, self.head_end - self.head_start, self.dst_ids.shape[0])
        self.coverage = torch.zeros(shape, dtype=torch.bool)
        self.source_keys = frozenset(s.key for s in self.descriptor.sources)
        # run[i] = how many blocks from position i on have consecutive ids (direct receive)
        ids = self.block_ids
        run = [1] * len(ids)
        for i in range(len(ids) - 2, -1, -1):
            if ids[i + 1] == ids[i] + 1:
                run[i] = run[i + 1] + 1
        self._run = run

    @property
    def transfer_id(self) -> bytes:
        return self.descriptor.transfer_id

    @property
    def deadline(self) -> float:
        return self.descriptor.deadline

    @property
    def expired(self) -> bool:
        return time.time() >= self.descriptor.deadline

    def fits(self, head_start: int, head_end: int, offset: int, num_blocks: int) -> str | None:
        """Why this slice is outside what was reserved, or None: checked for every entry of a
        message before any buffer is allocated for it, so a peer can't make the receiver
        allocate more than its reservations."""
        if not self.head_start <= head_start < head_end <= self.head_end:
            return (f"heads [{head_start}, {head_end}) are not within this rank's "
                    f"[{self.head_start}, {self.head_end})")
        if offset + num_blocks > self.dst_ids.shape[0]:
            return (f"blocks [{offset}, {offset + num_blocks}) overrun the "
                    f"{self.dst_ids.shape[0]} reserved blocks")
        return None

    def check_slice(self, layer: int, head_start: int, head_end: int, offset: int,
                    num_blocks: int) -> str | None:
        """Why this slice can't be written, or None."""
        why = self.fits(head_start, head_end, offset, num_blocks)
        if why is not None:
            return why
        cells = self._cells(layer, head_start, head_end, offset, num_blocks)
        if bool(cells.any()):
            return f"layer {layer} blocks [{offset}, {offset + num_blocks}) arrived twice"
        return None

    def claim(self, layer: int, head_start: int, head_end: int, offset: int,
              num_blocks: int, direct: bool) -> None:
        """`direct`: the transport writes straight into the blocks (in flight until released)."""
        self._cells(layer, head_start, head_end, offset, num_blocks).fill_(True)
        self.inflight += direct

    def land(self, head_start: int, head_end: int, num_blocks: int) -> None:
        """A claimed slice arrived (call `release` as well)."""
        self.received += (head_end - head_start) * num_blocks

    def release(self) -> None:
        """A direct slice is no longer in flight (landed, or its recv failed)."""
        assert self.inflight > 0
        self.inflight -= 1

    def consecutive(self, offset: int, num_blocks: int) -> bool:
        """Whether destination blocks [offset, offset + num_blocks) have consecutive ids."""
        return self._run[offset] >= num_blocks

    @property
    def settled(self) -> bool:
        return self.state is not TransferState.PENDING and self.inflight == 0

    def missing(self, head_start: int, head_end: int) -> int:
        """(layer, head, block) cells of this head range that never arrived."""
        h0, h1 = head_start - self.head_start, head_end - self.head_start
        return int((~self.coverage[:, max(h0, 0):max(h1, 0)]).sum())

    @property
    def complete(self) -> bool:
        return self.received == self.coverage.numel()

    def _cells(self, layer: int, head_start: int, head_end: int, offset: int,
               num_blocks: int) -> torch.Tensor:
        h0, h1 = head_start - self.head_start, head_end - self.head_start
        return self.coverage[layer, h0:h1, offset:offset + num_blocks]
