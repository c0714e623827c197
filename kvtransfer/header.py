"""The data-plane message header: a fixed 4096-byte little-endian struct, no pickle.

Every data-plane message starts with one header, sent before (and apart from) its payload:

    LAYER  K and V of one layer for up to MAX_TRANSFERS requests, one head range; the payload
           is `pack_blocks` of all their blocks concatenated: [2, sum(num_blocks), block_size,
           head_end - head_start, head_dim] in the layout's dtype
    DONE   the sender has pushed everything it will push for these transfers (no payload)
    ERROR  the sender gives these transfers up, with an ErrorCode (no payload)

A LAYER payload travels in one of two forms, told apart by `flags`:

    packed     (flags 0) one message: the [2, sum(num_blocks), ...] buffer above
    SEGMENTED  two messages per transfer entry, in entry order: its K blocks
               [num_blocks, block_size, heads, head_dim], then its V blocks. Each can be sent
               straight from a run of consecutive source blocks and received straight into a
               run of consecutive destination blocks: no gather, no scatter, no staging copy

Fixed part (84 bytes), then MAX_TRANSFERS entries of (transfer_id 16s, block_offset u32,
num_blocks u32), unused entries and the tail zero:

    magic 4s | version u16 | kind u8 | code u8 | layout_id 16s | group_id u64 | seq u64 |
    layer u32 | num_transfers u32 | head_start u16 | head_end u16 | dtype u8 | reserved u8 |
    reserved u16 | block_size u32 | head_dim u32 | payload_nbytes u64 | deadline f64 |
    reserved u32

`decode` trusts nothing: it checks the size, magic, version, kind, layout, every count and
bound, that the payload size is exactly what the entries imply, and that no byte past the last
entry is set — with constant work (at most MAX_TRANSFERS entries), before anyone allocates a
payload buffer from `payload_nbytes`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace
from enum import IntEnum

from pdserve.kvtransfer.errors import ErrorCode
from pdserve.kvtransfer.layout import KVLayout

MAGIC = b"PDKV"
VERSION = 1
HEADER_SIZE = 4096
MAX_TRANSFERS = 128
MAX_BLOCKS_PER_TRANSFER = 1 << 20
DEFAULT_MAX_PAYLOAD_NBYTES = 1 << 32

_FIXED = struct.Struct("<4sHBB16sQQIIHHBBHIIQdI")
_ENTRY = struct.Struct("<16sII")
_ENTRIES_END = _FIXED.size + MAX_TRANSFERS * _ENTRY.size
assert _ENTRIES_END <= HEADER_SIZE
_ZERO_ID = bytes(16)


FLAG_SEGMENTED = 1


class Kind(IntEnum):
    LAYER = 1
    DONE = 2
    ERROR = 3


class HeaderError(ValueError):
    """A header that is malformed, hostile, or not for this receiver."""


class LayoutMismatchError(HeaderError):
    """A well-formed header for another KV layout: no payload may be received for it."""


@dataclass(frozen=True)
class TransferSlice:
    """Blocks `[block_offset, block_offset + num_blocks)` of one request, in payload order."""

    transfer_id: bytes
    block_offset: int
    num_blocks: int


@dataclass(frozen=True)
class MessageHeader:
    kind: Kind
    code: ErrorCode
    layout_id: bytes
    group_id: int  # the sender's batch: one per prefill batch and destination rank
    seq: int  # per channel, 0, 1, 2, ...: the payload tag, and a check nothing was lost
    layer: int
    head_start: int  # global KV-head range of the payload
    head_end: int
    dtype_code: int
    block_size: int
    head_dim: int
    payload_nbytes: int
    deadline: float  # absolute time.time() seconds: the earliest deadline of the transfers
    transfers: tuple[TransferSlice, ...]
    flags: int = 0

    @property
    def segmented(self) -> bool:
        return bool(self.flags & FLAG_SEGMENTED)

    @classmethod
    def for_layer(
        cls, layout: KVLayout, group_id: int, layer: int, head_start: int, head_end: int,
        transfers: tuple[TransferSlice, ...], deadline: float, segmented: bool = False,
    ) -> MessageHeader:
        total = sum(t.num_blocks for t in transfers)
        return cls(Kind.LAYER, ErrorCode.NONE, layout.layout_id, group_id, 0, layer,
                   head_start, head_end, layout.dtype_code, layout.block_size, layout.head_dim,
                   total * layout.block_nbytes(head_end - head_start), deadline, transfers,
                   FLAG_SEGMENTED if segmented else 0)

    @classmethod
    def for_control(
        cls, layout: KVLayout, kind: Kind, code: ErrorCode, group_id: int, head_start: int,
        head_end: int, transfer_ids: tuple[bytes, ...], deadline: float,
    ) -> MessageHeader:
        """A DONE or ERROR header (no payload)."""
        slices = tuple(TransferSlice(t, 0, 0) for t in transfer_ids)
        return cls(kind, code, layout.layout_id, group_id, 0, 0, head_start, head_end,
                   layout.dtype_code, layout.block_size, layout.head_dim, 0, deadline, slices)

    def with_seq(self, seq: int) -> MessageHeader:
        return replace(self, seq=seq)

    @property
    def num_blocks(self) -> int:
        return sum(t.num_blocks for t in self.transfers)

    def encode(self, layout: KVLayout) -> bytes:
        """HEADER_SIZE bytes; raises HeaderError if this header would not decode."""
        if not 0 < len(self.transfers) <= MAX_TRANSFERS:
            raise HeaderError(f"a message carries 1..{MAX_TRANSFERS} transfers, got "
                              f"{len(self.transfers)}: split the batch")
        if any(len(t.transfer_id) != 16 for t in self.transfers):
            raise HeaderError("transfer ids are 16 bytes")
        try:
            fixed = _FIXED.pack(
                MAGIC, VERSION, self.kind, self.code, self.layout_id, self.group_id, self.seq,
                self.layer, len(self.transfers), self.head_start, self.head_end,
                self.dtype_code, self.flags, 0, self.block_size, self.head_dim, self.payload_nbytes,
                self.deadline, 0)
            entries = b"".join(_ENTRY.pack(t.transfer_id, t.block_offset, t.num_blocks)
                               for t in self.transfers)
        except struct.error as e:
            raise HeaderError(f"header field out of range: {e}") from None
        data = (fixed + entries).ljust(HEADER_SIZE, b"\0")
        decode(data, layout)  # the sender refuses what the receiver would refuse
        return data


def decode(
    data: bytes | bytearray | memoryview, expected: KVLayout,
    max_payload_nbytes: int = DEFAULT_MAX_PAYLOAD_NBYTES,
) -> MessageHeader:
    """Validate and parse one header; raises HeaderError (LayoutMismatchError) on anything off."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise HeaderError(f"a header is bytes, got {type(data).__name__}")
    data = bytes(data) if len(data) == HEADER_SIZE else data
    if len(data) != HEADER_SIZE:
        raise HeaderError(f"a header is exactly {HEADER_SIZE} bytes, got {len(data)}")
    (magic, version, kind, code, layout_id, group_id, seq, layer, count, head_start, head_end,
     dtype_code, flags, res2, block_size, head_dim, payload_nbytes, deadline, res3,
     ) = _FIXED.unpack_from(data)
    _check_identity(magic, version, layout_id, (dtype_code, block_size, head_dim), expected)
    if res2 or res3:
        raise HeaderError("reserved header fields must be zero")
    kind = _kind(kind, code)
    if flags & ~FLAG_SEGMENTED or (flags and kind != Kind.LAYER):
        raise HeaderError(f"flags {flags:#x}: unknown, or on a header without payload")
    _check_range(kind, layer, head_start, head_end, expected)
    if not 1 <= count <= MAX_TRANSFERS:
        raise HeaderError(f"num_transfers must be in [1, {MAX_TRANSFERS}], got {count}")
    slices = _entries(data, count, kind)
    if any(data[_FIXED.size + count * _ENTRY.size:]):
        raise HeaderError("bytes after the last transfer entry must be zero")
    _check_payload(kind, slices, payload_nbytes, head_end - head_start, expected,
                   max_payload_nbytes)
    if not math.isfinite(deadline) or deadline <= 0:
        raise HeaderError(f"deadline must be a finite positive time, got {deadline}")
    return MessageHeader(kind, ErrorCode(code), layout_id, group_id, seq, layer, head_start,
                         head_end, dtype_code, block_size, head_dim, payload_nbytes, deadline,
                         slices, flags)


def _check_identity(magic: bytes, version: int, layout_id: bytes,
                    shape: tuple[int, int, int], expected: KVLayout) -> None:
    """A pdserve message of this version, for this worker's exact KV layout."""
    if magic != MAGIC:
        raise HeaderError(f"bad magic {magic!r}: not a pdserve KV message")
    if version != VERSION:
        raise HeaderError(f"header version {version}, this build speaks {VERSION}")
    if layout_id != expected.layout_id:
        raise LayoutMismatchError(
            f"header layout id {layout_id.hex()} != this worker's {expected.layout_id.hex()} "
            f"({expected}): prefill and decode run different models or cache configs")
    if shape != (expected.dtype_code, expected.block_size, expected.head_dim):
        raise HeaderError(f"dtype/block_size/head_dim {shape} contradict layout id "
                          f"{layout_id.hex()}")


def _kind(kind: int, code: int) -> Kind:
    if kind not in Kind._value2member_map_:
        raise HeaderError(f"unknown message kind {kind}")
    if code not in ErrorCode._value2member_map_:
        raise HeaderError(f"unknown error code {code}")
    if (kind == Kind.ERROR) != (code != ErrorCode.NONE):
        raise HeaderError("an ERROR header needs an error code, other kinds must have none")
    return Kind(kind)


def _check_range(kind: Kind, layer: int, head_start: int, head_end: int, layout: KVLayout) -> None:
    if kind == Kind.LAYER and layer >= layout.num_layers:
        raise HeaderError(f"layer {layer} out of range: the layout has {layout.num_layers}")
    if kind != Kind.LAYER and layer != 0:
        raise HeaderError(f"a {kind.name} header has layer 0, got {layer}")
    if not 0 <= head_start < head_end <= layout.num_kv_heads:
        raise HeaderError(f"head range [{head_start}, {head_end}) is not within the layout's "
                          f"{layout.num_kv_heads} KV heads")


def _entries(data: bytes, count: int, kind: Kind) -> tuple[TransferSlice, ...]:
    slices, seen = [], set()
    for i in range(count):
        tid, offset, num = _ENTRY.unpack_from(data, _FIXED.size + i * _ENTRY.size)
        if tid == _ZERO_ID or tid in seen:
            raise HeaderError(f"transfer entry {i}: zero or repeated transfer id")
        seen.add(tid)
        if kind == Kind.LAYER and not (num >= 1 and offset + num <= MAX_BLOCKS_PER_TRANSFER):
            raise HeaderError(f"transfer entry {i}: blocks [{offset}, {offset + num}) must be "
                              f"non-empty and end by {MAX_BLOCKS_PER_TRANSFER}")
        if kind != Kind.LAYER and (offset or num):
            raise HeaderError(f"transfer entry {i}: a {kind.name} header carries no blocks")
        slices.append(TransferSlice(tid, offset, num))
    return tuple(slices)


def _check_payload(
    kind: Kind, slices: tuple[TransferSlice, ...], nbytes: int, num_heads: int,
    layout: KVLayout, max_nbytes: int,
) -> None:
    expected = sum(s.num_blocks for s in slices) * layout.block_nbytes(num_heads)
    if nbytes != expected:
        raise HeaderError(f"payload_nbytes {nbytes} != {expected} implied by the entries")
    if nbytes > max_nbytes:
        raise HeaderError(f"payload of {nbytes} bytes exceeds this receiver's max {max_nbytes}")
