"""The data-plane header: round trip, hostile inputs, fuzz (decode or HeaderError, nothing else)."""

from __future__ import annotations

import dataclasses
import random
import struct
import time

import pytest

from pdserve.kvtransfer import header as H
from pdserve.kvtransfer.errors import ErrorCode
from pdserve.kvtransfer.header import (
    HEADER_SIZE,
    MAX_TRANSFERS,
    HeaderError,
    Kind,
    LayoutMismatchError,
    MessageHeader,
    TransferSlice,
    decode,
)
from tests.kvtransfer.kvdata import TINY

DEADLINE = time.time() + 60
IDS = [bytes([i + 1]) * 16 for i in range(3)]


def layer_header(**changes) -> MessageHeader:
    slices = (TransferSlice(IDS[0], 0, 3), TransferSlice(IDS[1], 5, 2))
    h = MessageHeader.for_layer(TINY, 9, 2, 1, 3, slices, DEADLINE).with_seq(4)
    return dataclasses.replace(h, **changes)


def raw(**fields) -> bytes:
    """A header encoded field by field, bypassing every check (the hostile sender)."""
    f = dict(magic=H.MAGIC, version=H.VERSION, kind=1, code=0, layout_id=TINY.layout_id,
             group_id=1, seq=0, layer=0, count=1, head_start=0, head_end=4,
             dtype=TINY.dtype_code, flags=0, r2=0, block_size=TINY.block_size,
             head_dim=TINY.head_dim, nbytes=TINY.block_nbytes(4), deadline=DEADLINE, r3=0)
    entries = fields.pop("entries", [(IDS[0], 0, 1)])
    f.update(fields)
    data = H._FIXED.pack(*f.values()) + b"".join(H._ENTRY.pack(*e) for e in entries)
    return data.ljust(HEADER_SIZE, b"\0")


def test_round_trip() -> None:
    h = layer_header()
    data = h.encode(TINY)
    assert len(data) == HEADER_SIZE
    assert decode(data, TINY) == h
    assert h.payload_nbytes == 5 * TINY.block_nbytes(2)
    assert decode(bytearray(data), TINY) == h and decode(memoryview(data), TINY) == h


def test_segmented_flag_round_trips() -> None:
    h = MessageHeader.for_layer(TINY, 9, 2, 1, 3, (TransferSlice(IDS[0], 0, 3),), DEADLINE,
                                segmented=True)
    assert decode(h.encode(TINY), TINY).segmented
    assert decode(raw(flags=1), TINY).segmented


def test_control_headers_round_trip() -> None:
    for kind, code in ((Kind.DONE, ErrorCode.NONE), (Kind.ERROR, ErrorCode.PREFILL_FAILED)):
        h = MessageHeader.for_control(TINY, kind, code, 3, 0, 4, tuple(IDS), DEADLINE)
        assert decode(h.encode(TINY), TINY) == h


def test_raw_helper_builds_a_valid_header() -> None:
    assert decode(raw(), TINY).transfers == (TransferSlice(IDS[0], 0, 1),)


@pytest.mark.parametrize("data", [
    b"", b"PDKV", raw()[:-1], raw() + b"\0", raw()[:H._FIXED.size], "text", None,
], ids=["empty", "magic", "one-short", "one-long", "fixed-part", "text", "none"])
def test_wrong_size_or_type(data) -> None:
    with pytest.raises(HeaderError):
        decode(data, TINY)


HOSTILE = {
    "magic": dict(magic=b"PDKX"),
    "version": dict(version=2),
    "kind": dict(kind=9),
    "kind zero": dict(kind=0),
    "error code on a layer": dict(code=3),
    "unknown error code": dict(kind=3, code=200, nbytes=0, entries=[(IDS[0], 0, 0)]),
    "error without code": dict(kind=3, code=0, nbytes=0, entries=[(IDS[0], 0, 0)]),
    "done with blocks": dict(kind=2, nbytes=0, entries=[(IDS[0], 0, 1)]),
    "done with a layer": dict(kind=2, layer=1, nbytes=0, entries=[(IDS[0], 0, 0)]),
    "dtype contradicts id": dict(dtype=2),
    "block size contradicts id": dict(block_size=16),
    "head dim contradicts id": dict(head_dim=0xFFFFFFFF),
    "unknown flag": dict(flags=2),
    "flags on a done": dict(kind=2, flags=1, nbytes=0, entries=[(IDS[0], 0, 0)]),
    "reserved 2": dict(r2=1),
    "reserved 3": dict(r3=7),
    "layer past the model": dict(layer=3),
    "layer huge": dict(layer=0xFFFFFFFF),
    "no transfers": dict(count=0),
    "huge count": dict(count=0xFFFFFFFF),
    "count past max": dict(count=MAX_TRANSFERS + 1),
    "count beyond entries": dict(count=2),  # entry 2 is all zero
    "empty head range": dict(head_start=2, head_end=2),
    "reversed head range": dict(head_start=3, head_end=1),
    "heads past the model": dict(head_start=0, head_end=5, nbytes=TINY.block_nbytes(5)),
    "heads huge": dict(head_end=0xFFFF),
    "zero blocks": dict(entries=[(IDS[0], 0, 0)]),
    "offset overflow": dict(entries=[(IDS[0], 0xFFFFFFFF, 1)], nbytes=TINY.block_nbytes(4)),
    "blocks overflow": dict(entries=[(IDS[0], 0, 0xFFFFFFFF)],
                            nbytes=0xFFFFFFFF * TINY.block_nbytes(4)),
    "zero transfer id": dict(entries=[(bytes(16), 0, 1)]),
    "repeated transfer id": dict(count=2, entries=[(IDS[0], 0, 1), (IDS[0], 1, 1)],
                                 nbytes=2 * TINY.block_nbytes(4)),
    "payload too small": dict(nbytes=TINY.block_nbytes(4) - 1),
    "payload too big": dict(nbytes=TINY.block_nbytes(4) + 1),
    "payload max u64": dict(nbytes=(1 << 64) - 1),
    "nan deadline": dict(deadline=float("nan")),
    "inf deadline": dict(deadline=float("inf")),
    "negative deadline": dict(deadline=-5.0),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_headers_raise_header_error(name: str) -> None:
    with pytest.raises(HeaderError):
        decode(raw(**HOSTILE[name]), TINY)


def test_trailing_garbage_after_the_entries() -> None:
    data = bytearray(raw())
    data[H._FIXED.size + H._ENTRY.size + 3] = 1  # inside the (unused) second entry
    with pytest.raises(HeaderError, match="must be zero"):
        decode(bytes(data), TINY)
    data = bytearray(raw())
    data[-1] = 0xFF  # the padding tail
    with pytest.raises(HeaderError, match="must be zero"):
        decode(bytes(data), TINY)


def test_payload_bound_is_the_receivers_choice() -> None:
    data = raw()
    assert decode(data, TINY, max_payload_nbytes=TINY.block_nbytes(4)).payload_nbytes > 0
    with pytest.raises(HeaderError, match="exceeds"):
        decode(data, TINY, max_payload_nbytes=TINY.block_nbytes(4) - 1)


def test_layout_mismatch_is_its_own_error() -> None:
    other = dataclasses.replace(TINY, block_size=8)
    with pytest.raises(LayoutMismatchError, match="different models or cache configs"):
        decode(layer_header().encode(TINY), other)


def test_encode_refuses_what_decode_would() -> None:
    with pytest.raises(HeaderError):
        layer_header(layer=TINY.num_layers).encode(TINY)
    with pytest.raises(HeaderError, match="split the batch"):
        slices = tuple(TransferSlice(i.to_bytes(16, "big"), 0, 1) for i in range(1, 130))
        MessageHeader.for_layer(TINY, 1, 0, 0, 4, slices, DEADLINE).encode(TINY)
    with pytest.raises(HeaderError, match="out of range"):
        layer_header(group_id=-1).encode(TINY)
    with pytest.raises(HeaderError, match="16 bytes"):
        layer_header(transfers=(TransferSlice(b"short", 0, 1),)).encode(TINY)


def test_max_transfers_fit() -> None:
    slices = tuple(TransferSlice(i.to_bytes(16, "big"), i, 1) for i in range(1, MAX_TRANSFERS + 1))
    h = MessageHeader.for_layer(TINY, 1, 0, 0, 4, slices, DEADLINE)
    assert decode(h.encode(TINY), TINY).transfers == slices


def _decode_or_header_error(data: bytes) -> None:
    try:
        h = decode(data, TINY)
    except HeaderError:
        return
    assert h.layout_id == TINY.layout_id and 1 <= len(h.transfers) <= MAX_TRANSFERS


def test_fuzz_random_bytes() -> None:
    rng = random.Random(1)
    for _ in range(3000):
        _decode_or_header_error(rng.randbytes(HEADER_SIZE))
    for _ in range(500):
        _decode_or_header_error(rng.randbytes(rng.randrange(2 * HEADER_SIZE)))


def test_fuzz_mutated_valid_headers() -> None:
    """Flips inside the meaningful prefix (random bytes alone never get past the magic)."""
    rng = random.Random(2)
    good = layer_header().encode(TINY)
    prefix = H._FIXED.size + 3 * H._ENTRY.size
    accepted = 0
    for _ in range(5000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(prefix)] = rng.randrange(256)
        try:
            decode(bytes(data), TINY)
            accepted += 1
        except HeaderError:
            pass
    assert 0 < accepted < 5000  # some flips are harmless (ids, group, seq), most are not


def test_struct_sizes() -> None:
    assert H._FIXED.size == 84 and H._ENTRY.size == 24
    assert struct.calcsize("<16sII") * MAX_TRANSFERS + H._FIXED.size <= HEADER_SIZE
