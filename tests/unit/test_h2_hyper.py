"""The router's HTTP/2 front held to python-hyper's independent implementation.

`h2` (python-hyper's HTTP/2 state machine) drives real calls and checks every frame the
server sends back: it raises on any protocol violation (a frame on a closed stream, a window
overrun, a malformed header block, trailers without END_STREAM). `hyperframe` builds the
malformed frames RFC 9113 names, and parses what the server answers: the connection error it
must send as GOAWAY, or the stream error as RST_STREAM, after which the connection goes on.
"""

from __future__ import annotations

import asyncio

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    PushPromiseFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from pdserve.router.h2.server import Method
from tests.unit.test_h2_protocol import ECHO, STREAM, echo_methods, message, raw, serve

PROTOCOL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR, COMPRESSION_ERROR = (
    0x1, 0x3, 0x5, 0x6, 0x9)
REQUEST = [(":method", "POST"), (":scheme", "http"), (":path", ECHO), (":authority", "x"),
           ("content-type", "application/grpc"), ("te", "trailers")]


async def stream_three(request, context):
    for i in range(3):
        yield request + bytes([i])


METHODS = echo_methods(**{STREAM: Method("server_stream", stream_three, raw, raw)})


async def read_frames(reader: asyncio.StreamReader, until, timeout: float = 2.0) -> list[Frame]:
    """Frames parsed by hyperframe, up to the first `until` accepts (or the close)."""
    frames = []
    while True:
        try:
            head = await asyncio.wait_for(reader.readexactly(9), timeout)
        except asyncio.IncompleteReadError:
            return frames
        frame, length = Frame.parse_frame_header(memoryview(head))
        frame.parse_body(memoryview(await asyncio.wait_for(reader.readexactly(length),
                                                           timeout)))
        frames.append(frame)
        if until(frame):
            return frames


def test_calls_pass_h2s_checks_with_a_small_window():
    """Unary and server-streaming calls, interleaved, under a 7-byte stream window that
    the client grows only as it consumes: h2 sees every frame and finds nothing wrong."""

    async def scenario(harness):
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.port)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 7})
        writer.write(conn.data_to_send())
        acked = False  # the window applies once the server acknowledged it
        while not acked:
            data = await asyncio.wait_for(reader.read(65536), 2.0)
            events = conn.receive_data(data)
            acked = any(isinstance(e, h2.events.SettingsAcknowledged) for e in events)
            writer.write(conn.data_to_send())
        bodies: dict[int, bytes] = {}
        for stream_id, path in ((1, ECHO), (3, STREAM), (5, ECHO)):
            conn.send_headers(stream_id, [(k, path if k == ":path" else v) for k, v in REQUEST])
            conn.send_data(stream_id, message(b"abcdefghij"), end_stream=True)
            bodies[stream_id] = b""
        writer.write(conn.data_to_send())
        ended, status = set(), {}
        while len(ended) < 3:
            data = await asyncio.wait_for(reader.read(65536), 2.0)
            assert data, "the server closed the connection"
            for event in conn.receive_data(data):  # raises on any protocol violation
                if isinstance(event, h2.events.DataReceived):
                    bodies[event.stream_id] += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length,
                                                   event.stream_id)
                elif isinstance(event, h2.events.TrailersReceived):
                    status[event.stream_id] = dict(event.headers)[b"grpc-status"]
                elif isinstance(event, h2.events.StreamEnded):
                    ended.add(event.stream_id)
            writer.write(conn.data_to_send())
        writer.close()
        return bodies, status

    bodies, status = serve(METHODS, scenario)
    assert status == {1: b"0", 3: b"0", 5: b"0"}
    assert bodies[1] == bodies[5] == message(b"abcdefghij")
    assert bodies[3] == b"".join(message(b"abcdefghij" + bytes([i])) for i in range(3))


def frame(cls, stream_id: int, **fields) -> bytes:
    """A hyperframe frame, any field set after construction (so the malformed ones too)."""
    made = cls(1 if stream_id == 0 and cls not in (SettingsFrame, PingFrame, GoAwayFrame,
                                                   WindowUpdateFrame) else stream_id)
    made.stream_id = stream_id
    for name, value in fields.items():
        setattr(made, name, value)
    return made.serialize()


def block(headers) -> bytes:
    return hpack.Encoder().encode(headers)


def open_stream(stream_id: int, end_stream: bool = False) -> bytes:
    return frame(HeadersFrame, stream_id, data=block(REQUEST),
                 flags={"END_HEADERS", *({"END_STREAM"} if end_stream else ())})


# RFC 9113's connection errors: the server answers GOAWAY with this code and closes.
CONNECTION_ERRORS = {
    "DATA on stream 0 (6.1)": (frame(DataFrame, 0, data=b"x"), PROTOCOL_ERROR),
    "HEADERS opening an even stream (5.1.1)": (
        frame(HeadersFrame, 2, data=block(REQUEST), flags={"END_HEADERS"}), PROTOCOL_ERROR),
    "HEADERS padded past its length (6.2)": (
        bytes.fromhex("000001") + bytes([0x1, 0x4 | 0x8]) + (1).to_bytes(4, "big") + b"\x05",
        PROTOCOL_ERROR),
    "PRIORITY on stream 0 (6.3)": (frame(PriorityFrame, 0), PROTOCOL_ERROR),
    "RST_STREAM on an idle stream (6.4)": (frame(RstStreamFrame, 9), PROTOCOL_ERROR),
    "SETTINGS ack with a payload (6.5)": (
        bytes.fromhex("000006040100000000") + bytes(6), FRAME_SIZE_ERROR),
    "SETTINGS not a multiple of 6 (6.5)": (bytes.fromhex("000005040000000000") + bytes(5),
                                           FRAME_SIZE_ERROR),
    "SETTINGS_ENABLE_PUSH of 2 (6.5.2)": (frame(SettingsFrame, 0, settings={0x2: 2}),
                                           PROTOCOL_ERROR),
    "SETTINGS_INITIAL_WINDOW_SIZE over 2^31-1 (6.5.2)": (
        frame(SettingsFrame, 0, settings={0x4: 2**31}), FLOW_CONTROL_ERROR),
    "SETTINGS_MAX_FRAME_SIZE under 16384 (6.5.2)": (
        frame(SettingsFrame, 0, settings={0x5: 100}), PROTOCOL_ERROR),
    "PUSH_PROMISE from a client (8.4)": (
        frame(PushPromiseFrame, 1, promised_stream_id=2, data=block(REQUEST),
              flags={"END_HEADERS"}), PROTOCOL_ERROR),
    "PING of 4 bytes (6.7)": (bytes.fromhex("000004060000000000") + bytes(4),
                              FRAME_SIZE_ERROR),
    "WINDOW_UPDATE of 0 on the connection (6.9)": (
        frame(WindowUpdateFrame, 0, window_increment=0), PROTOCOL_ERROR),
    "WINDOW_UPDATE on an idle stream (5.1)": (
        frame(WindowUpdateFrame, 11, window_increment=5), PROTOCOL_ERROR),
    "CONTINUATION without HEADERS (6.10)": (
        frame(ContinuationFrame, 1, data=block(REQUEST), flags={"END_HEADERS"}),
        PROTOCOL_ERROR),
    "a header block that does not decode (4.3)": (
        frame(HeadersFrame, 1, data=b"\xff\xff\xff\xff", flags={"END_HEADERS"}),
        COMPRESSION_ERROR),
    "DATA after END_STREAM (5.1)": (
        open_stream(1, end_stream=True) + frame(DataFrame, 1, data=b"x"), STREAM_CLOSED),
}


@pytest.mark.parametrize("case", CONNECTION_ERRORS)
def test_a_connection_error_is_a_goaway_with_its_code(case):
    data, code = CONNECTION_ERRORS[case]

    async def scenario(harness):
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.port)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        writer.write(conn.data_to_send() + data)
        frames = await read_frames(reader, lambda fr: isinstance(fr, GoAwayFrame))
        rest = await read_frames(reader, lambda fr: False)  # then the server closes
        writer.close()
        return frames, rest

    frames, rest = serve(METHODS, scenario)
    goaway = frames[-1]
    assert isinstance(goaway, GoAwayFrame), (case, frames)
    assert goaway.error_code == code, (case, goaway.error_code)
    assert not [fr for fr in rest if not isinstance(fr, (SettingsFrame, PingFrame))], rest


def request_with(change) -> list[tuple[str, str]]:
    return change(list(REQUEST))


# RFC 9113 8.2-8.3: a malformed request is a stream error: RST_STREAM PROTOCOL_ERROR on its
# stream, and the connection serves the next call.
MALFORMED = {
    "an uppercase field name": lambda h: h + [("X-Upper", "1")],
    "a connection-specific field": lambda h: h + [("connection", "keep-alive")],
    "te other than trailers": lambda h: [(k, "gzip" if k == "te" else v) for k, v in h],
    "a pseudo-header after a regular field": lambda h: h[1:] + h[:1],
    "no :scheme": lambda h: [(k, v) for k, v in h if k != ":scheme"],
    "a response pseudo-header": lambda h: h + [(":status", "200")],
    "an unknown pseudo-header": lambda h: [h[0], (":protocol", "x"), *h[1:]],
    "two :path": lambda h: [h[0], (":path", ECHO), *h[1:]],
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_request_is_reset_and_the_connection_goes_on(case):
    async def scenario(harness):
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.port)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        bad = frame(HeadersFrame, 1, data=block(request_with(MALFORMED[case])),
                    flags={"END_HEADERS"})
        good = open_stream(3) + frame(DataFrame, 3, data=message(b"ok"),
                                      flags={"END_STREAM"})
        writer.write(conn.data_to_send() + bad + good)
        frames = await read_frames(
            reader, lambda fr: fr.stream_id == 3 and "END_STREAM" in fr.flags)
        writer.close()
        return frames

    frames = serve(METHODS, scenario)
    resets = [fr for fr in frames if isinstance(fr, RstStreamFrame)]
    assert [(fr.stream_id, fr.error_code) for fr in resets] == [(1, PROTOCOL_ERROR)], frames
    assert not any(isinstance(fr, GoAwayFrame) for fr in frames)
    data = b"".join(fr.data for fr in frames if isinstance(fr, DataFrame) and fr.stream_id == 3)
    assert data == message(b"ok")
