"""HTTP/2 frames (RFC 9113) as the router's gRPC front writes them, and the header fields it sends.

Only what a server needs: the frame header, SETTINGS, and header blocks written as HPACK
literals without indexing (RFC 7541 6.2.2). The encoder keeps no dynamic table, so nothing a
client sends can change what it writes; decoding a client's header block is hpack's.
"""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADER = struct.Struct(">I B I")  # 24-bit length in the first 3 bytes of the I, type, flags, stream

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20

# SETTINGS identifiers
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, \
    MAX_HEADER_LIST_SIZE = range(1, 7)

# error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT, STREAM_CLOSED, \
    FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, CONNECT_ERROR, \
    ENHANCE_YOUR_CALM = range(12)

DEFAULT_WINDOW = 65535
DEFAULT_FRAME_SIZE = 16384
MAX_WINDOW = 2**31 - 1


class H2Error(Exception):
    """A connection error: GOAWAY with `code`, then close."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags))
            + stream_id.to_bytes(4, "big") + payload)


def parse_header(data: bytes | memoryview, at: int) -> tuple[int, int, int, int]:
    """(length, type, flags, stream id) of the frame header at `at`."""
    word, flags, stream_id = HEADER.unpack_from(data, at)
    return word >> 8, word & 0xFF, flags, stream_id & MAX_WINDOW


def settings(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in values.items()))


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    if len(payload) % 6:
        raise H2Error(FRAME_SIZE_ERROR, "SETTINGS length is not a multiple of 6")
    return [struct.unpack_from(">HI", payload, i) for i in range(0, len(payload), 6)]


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, code.to_bytes(4, "big"))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, struct.pack(">II", last_stream_id, code) + debug)


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) with `first`'s high bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out, value = bytearray((first | limit,)), value - limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """One header field, literal without indexing, new name, no Huffman coding."""
    return _integer(0, 4) + _integer(len(name), 7) + name + _integer(len(value), 7) + value


STATUS_200 = bytes((0x88,))  # ":status: 200", index 8 of the static table
