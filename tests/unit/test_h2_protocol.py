"""The router's own HTTP/2 gRPC front (pdserve.router.h2) at the wire level.

Each test starts a real GrpcServer on 127.0.0.1 and talks to it over a raw TCP socket with
frames written by hand (`frames` helpers, `hpack.Encoder` for request header blocks) and read
back one by one. Together they prove the server: answers unary and streaming calls with the
frames gRPC's HTTP/2 spec asks for (HEADERS, length-prefixed DATA, trailers with
grpc-status); maps unknown methods, oversized and compressed messages, deadlines and a failed
`authorize` to the right grpc-status without running the handler (or by cancelling it);
answers PING and SETTINGS; decodes header blocks split into CONTINUATION frames; and defends
itself: GOAWAY for a bad preface, an oversized frame, an interrupted header block and rapid
resets, REFUSED_STREAM past `max_streams`, a close for a silent connection, the client's
flow-control window respected, a client reset cancelling its handler, and a client that
stops reading pausing its writers instead of letting the server buffer without bound.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import hpack
import pytest

from pdserve.router.h2 import frames as f
from pdserve.router.h2.limits import Limits
from pdserve.router.h2.server import GrpcServer, Method

ECHO, STREAM, BLOCK, SLEEP, RECORD = "/t.S/Echo", "/t.S/Stream", "/t.S/Block", "/t.S/Sleep", \
    "/t.S/Record"
OK, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNIMPLEMENTED, UNAUTHENTICATED = 0, 4, 8, 12, 16


def raw(data: bytes) -> bytes:
    return data


def message(payload: bytes, compressed: bool = False) -> bytes:
    """One gRPC length-prefixed message."""
    return bytes((int(compressed),)) + len(payload).to_bytes(4, "big") + payload


class Frame(NamedTuple):
    kind: int
    flags: int
    stream: int
    payload: bytes
    headers: dict | None = None  # a HEADERS frame's decoded block

    @property
    def code(self) -> int:
        """The error code of a GOAWAY or RST_STREAM."""
        at = 4 if self.kind == f.GOAWAY else 0
        return int.from_bytes(self.payload[at:at + 4], "big")


@dataclass
class Response:
    frames: list[Frame] = field(default_factory=list)

    @property
    def headers(self) -> dict:
        return next(fr.headers for fr in self.frames if fr.kind == f.HEADERS)

    @property
    def trailers(self) -> dict:
        last = self.frames[-1]
        assert last.kind == f.HEADERS and last.flags & f.END_STREAM, self.frames
        return last.headers

    @property
    def status(self) -> int:
        return int(self.trailers["grpc-status"])

    @property
    def data(self) -> bytes:
        return b"".join(fr.payload for fr in self.frames if fr.kind == f.DATA)

    @property
    def kinds(self) -> list[int]:
        return [fr.kind for fr in self.frames]


class Client:
    """One raw HTTP/2 connection: frames written by hand, frames read back one at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder, self.decoder = hpack.Encoder(), hpack.Decoder()

    def send(self, *data: bytes) -> None:
        self.writer.write(b"".join(data))

    def headers(self, stream_id: int, path: str, extra=(), end_stream: bool = False,
                flags: int = f.END_HEADERS) -> bytes:
        return f.frame(f.HEADERS, flags | (f.END_STREAM if end_stream else 0), stream_id,
                       self.block(path, extra))

    def block(self, path: str, extra=()) -> bytes:
        return self.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                                    (":authority", "x"), ("content-type", "application/grpc"),
                                    ("te", "trailers"), *extra])

    def call(self, stream_id: int, path: str, payload: bytes, extra=()) -> bytes:
        """HEADERS, then one request message with END_STREAM."""
        return (self.headers(stream_id, path, extra)
                + f.frame(f.DATA, f.END_STREAM, stream_id, message(payload)))

    async def frame(self, timeout: float = 2.0) -> Frame | None:
        """The next frame; None once the server closed the connection."""
        try:
            head = await asyncio.wait_for(self.reader.readexactly(9), timeout)
            length, kind, flags, stream_id = f.parse_header(head, 0)
            payload = await asyncio.wait_for(self.reader.readexactly(length), timeout)
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return None
        headers = None
        if kind == f.HEADERS:
            assert flags & f.END_HEADERS, "the server split a header block"
            headers = dict(self.decoder.decode(payload))
        return Frame(kind, flags, stream_id, payload, headers)

    async def until(self, done, timeout: float = 2.0) -> list[Frame]:
        """Frames up to and including the first one `done` accepts."""
        seen = []
        while True:
            frame = await self.frame(timeout)
            assert frame is not None, f"the connection closed; frames so far: {seen}"
            seen.append(frame)
            if done(frame):
                return seen

    async def responses(self, *stream_ids: int, timeout: float = 2.0) -> dict[int, Response]:
        """Every frame of each stream until it ends (END_STREAM or RST_STREAM)."""
        out = {sid: Response() for sid in stream_ids}
        open_ = set(stream_ids)
        while open_:
            frame = await self.frame(timeout)
            assert frame is not None, f"the connection closed with {open_} open: {out}"
            if frame.stream in out:
                out[frame.stream].frames.append(frame)
                if frame.kind == f.RST_STREAM or (frame.kind == f.HEADERS
                                                  and frame.flags & f.END_STREAM):
                    open_.discard(frame.stream)
        return out

    async def response(self, stream_id: int, timeout: float = 2.0) -> Response:
        return (await self.responses(stream_id, timeout=timeout))[stream_id]

    async def closed(self, timeout: float = 2.0) -> list[Frame]:
        """The frames the server sent before closing the connection (fails if it does not)."""
        seen = []
        while (frame := await self.frame(timeout)) is not None:
            seen.append(frame)
        return seen

    def close(self) -> None:
        self.writer.close()


class Harness:
    def __init__(self, server: GrpcServer, port: int) -> None:
        self.server, self.port, self.clients = server, port, []

    async def connect(self, settings: dict | None = None, preface: bool = True,
                      sock: socket.socket | None = None) -> Client:
        if sock is None:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        else:
            reader, writer = await asyncio.open_connection(sock=sock)
        client = Client(reader, writer)
        self.clients.append(client)
        if preface:
            client.send(f.PREFACE, f.settings(settings or {}))
        return client


def serve(methods: dict, scenario, authorize=None, limits: Limits | None = None,
          timeout: float = 5.0):
    """Run `scenario(harness)` against a GrpcServer serving `methods`; its result."""

    async def main():
        server = GrpcServer(methods, authorize=authorize, limits=limits or Limits())
        port = server.bind("127.0.0.1", 0)
        await server.start()
        harness = Harness(server, port)
        try:
            return await scenario(harness)
        finally:
            for client in harness.clients:
                client.close()
            await server.stop(0)

    return asyncio.run(asyncio.wait_for(main(), timeout))


async def echo(request, context):
    return request


def echo_methods(**more) -> dict:
    return {ECHO: Method("unary", echo, raw, raw), **more}


# ---- 1 ----

def test_unary_call_gets_headers_one_message_and_ok_trailers():
    async def scenario(h: Harness):
        client = await h.connect()
        client.send(client.call(1, ECHO, b"hello"))
        return await client.response(1)

    response = serve(echo_methods(), scenario)
    assert response.kinds == [f.HEADERS, f.DATA, f.HEADERS]
    first, data, last = response.frames
    assert not first.flags & f.END_STREAM
    assert first.headers[":status"] == "200"
    assert first.headers["content-type"] == "application/grpc"
    assert data.payload == b"\x00" + (5).to_bytes(4, "big") + b"hello"
    assert last.flags & f.END_STREAM and last.flags & f.END_HEADERS
    assert last.headers["grpc-status"] == "0"


# ---- 2 ----

def test_unknown_method_gets_a_trailers_only_unimplemented():
    async def scenario(h: Harness):
        client = await h.connect()
        client.send(client.call(1, "/t.S/Nope", b"x"))
        return await client.response(1)

    response = serve(echo_methods(), scenario)
    assert response.kinds == [f.HEADERS]  # trailers-only: no DATA, one HEADERS
    only = response.frames[0]
    assert only.flags & f.END_STREAM
    assert only.headers[":status"] == "200"
    assert only.headers["grpc-status"] == str(UNIMPLEMENTED)
    assert "/t.S/Nope" in only.headers.get("grpc-message", "")


# ---- 3 ----

def test_bad_preface_gets_goaway_protocol_error_and_close():
    async def scenario(h: Harness):
        client = await h.connect(preface=False)
        client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        return await client.closed()

    frames = serve({}, scenario)
    goaways = [fr for fr in frames if fr.kind == f.GOAWAY]
    assert len(goaways) == 1 and goaways[0].code == f.PROTOCOL_ERROR
    assert frames[-1].kind == f.GOAWAY


# ---- 4 ----

def test_frame_over_16k_gets_goaway_frame_size_error():
    async def scenario(h: Harness):
        client = await h.connect()
        client.send(client.headers(1, ECHO), f.frame(f.DATA, 0, 1, b"\x00" * 16385))
        return await client.closed()

    frames = serve(echo_methods(), scenario)
    assert frames[-1].kind == f.GOAWAY and frames[-1].code == f.FRAME_SIZE_ERROR


# ---- 5 ----

def test_streams_over_max_streams_are_refused_and_the_others_complete():
    release, started = asyncio.Event(), []

    async def block(request, context):
        started.append(request)
        await release.wait()
        await context.write(request)

    async def scenario(h: Harness):
        nonlocal release
        release = asyncio.Event()  # bound to this loop
        client = await h.connect()
        client.send(client.call(1, BLOCK, b"a"), client.call(3, BLOCK, b"b"),
                    client.call(5, BLOCK, b"c"))
        refused = await client.response(5)
        release.set()
        return refused, await client.responses(1, 3)

    refused, done = serve({BLOCK: Method("stream", block, raw, raw)}, scenario,
                          limits=Limits(max_streams=2))
    assert refused.kinds == [f.RST_STREAM] and refused.frames[0].code == f.REFUSED_STREAM
    assert sorted(started) == [b"a", b"b"]  # the third handler never ran
    assert done[1].status == OK and done[1].data == message(b"a")
    assert done[3].status == OK and done[3].data == message(b"b")


# ---- 6 ----

def test_rapid_reset_gets_goaway_enhance_your_calm():
    async def block(request, context):
        await asyncio.Event().wait()

    async def scenario(h: Harness):
        client = await h.connect()

        def open_and_reset(first: int, n: int) -> bytes:
            return b"".join(client.headers(sid, BLOCK) + f.rst_stream(sid, f.CANCEL)
                            for sid in range(first, first + 2 * n, 2))

        client.send(open_and_reset(1, 5))  # the burst: still allowed
        client.send(f.frame(f.PING, 0, 0, b"burst ok"))
        before = await client.until(lambda fr: fr.kind == f.PING)
        client.send(open_and_reset(11, 3))
        return before, await client.closed()

    before, after = serve({BLOCK: Method("stream", block, raw, raw)}, scenario,
                          limits=Limits(resets_per_s=1, reset_burst=5))
    assert not [fr for fr in before if fr.kind == f.GOAWAY]
    assert before[-1].payload == b"burst ok"
    goaways = [fr for fr in after if fr.kind == f.GOAWAY]
    assert len(goaways) == 1 and goaways[0].code == f.ENHANCE_YOUR_CALM


# ---- 7 ----

def test_oversized_and_compressed_messages_are_refused_before_the_handler():
    ran = []

    async def record(request, context):
        ran.append(request)
        return request

    async def scenario(h: Harness):
        client = await h.connect()
        too_big = b"\x00" + (5000).to_bytes(4, "big") + b"x" * 10  # declares 5000 bytes
        client.send(client.headers(1, RECORD), f.frame(f.DATA, 0, 1, too_big))
        client.send(client.headers(3, RECORD),
                    f.frame(f.DATA, f.END_STREAM, 3, message(b"abc", compressed=True)))
        out = await client.responses(1, 3)
        await asyncio.sleep(0.05)  # a handler that was going to run has had its chance
        return out

    out = serve({RECORD: Method("unary", record, raw, raw)}, scenario,
                limits=Limits(max_message=1000))
    assert [fr.kind for fr in out[1].frames if fr.kind != f.RST_STREAM] == [f.HEADERS]
    assert out[1].frames[0].headers["grpc-status"] == str(RESOURCE_EXHAUSTED)
    assert out[3].status == UNIMPLEMENTED and f.DATA not in out[3].kinds
    assert ran == []


# ---- 8 ----

def test_server_respects_the_client_stream_window():
    async def stream(request, context):
        for _ in range(50):
            await context.write(b"m" * 20)  # 25 bytes a message on the wire

    async def drain(client: Client, quiet: float = 0.3) -> tuple[int, bool]:
        """DATA bytes on stream 1 until nothing comes for `quiet` s; whether it ended."""
        total = 0
        while True:
            try:
                frame = await client.frame(timeout=quiet)
            except TimeoutError:
                return total, False
            assert frame is not None
            if frame.stream == 1 and frame.kind == f.DATA:
                total += len(frame.payload)
            if frame.stream == 1 and frame.kind == f.HEADERS and frame.flags & f.END_STREAM:
                return total, frame.headers["grpc-status"] == "0"

    async def scenario(h: Harness):
        client = await h.connect({f.INITIAL_WINDOW_SIZE: 100})
        client.send(client.call(1, STREAM, b""))
        first = await drain(client)
        client.send(f.window_update(1, 200))
        second = await drain(client)
        client.send(f.window_update(1, 10_000))
        third = await drain(client)
        return first, second, third

    first, second, third = serve({STREAM: Method("stream", stream, raw, raw)}, scenario)
    assert first == (100, False)  # exactly the window, then nothing
    assert second == (200, False)
    assert third == (50 * 25 - 300, True)


# ---- 9 ----

def test_grpc_timeout_gives_deadline_exceeded_and_cancels_the_handler():
    saw_cancel = []

    async def sleep(request, context):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            saw_cancel.append(True)
            raise

    async def scenario(h: Harness):
        client = await h.connect()
        start = time.monotonic()
        client.send(client.call(1, SLEEP, b"", extra=[("grpc-timeout", "200m")]))
        response = await client.response(1)
        return response, time.monotonic() - start

    response, elapsed = serve({SLEEP: Method("unary", sleep, raw, raw)}, scenario)
    assert response.status == DEADLINE_EXCEEDED
    assert 0.15 <= elapsed < 1.0
    assert saw_cancel == [True]


# ---- 10 ----

def test_client_reset_cancels_the_handler_and_the_connection_goes_on():
    state = {}

    async def stream(request, context):
        try:
            while True:
                await context.write(b"tick")
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            state["cancelled"].set()
            raise

    async def scenario(h: Harness):
        state["cancelled"] = asyncio.Event()
        client = await h.connect()
        client.send(client.call(1, STREAM, b""))
        await client.until(lambda fr: fr.stream == 1 and fr.kind == f.DATA)
        client.send(f.rst_stream(1, f.CANCEL))
        await asyncio.wait_for(state["cancelled"].wait(), 1.0)
        client.send(client.call(3, ECHO, b"again"))
        return await client.response(3)

    response = serve(echo_methods(**{STREAM: Method("stream", stream, raw, raw)}), scenario)
    assert response.status == OK and response.data == message(b"again")


# ---- 11 ----

def test_ping_and_settings_are_acknowledged():
    async def scenario(h: Harness):
        client = await h.connect()  # the preface's SETTINGS: one ack
        client.send(f.frame(f.PING, f.ACK, 0, b"not-echo"),  # an ack is not answered
                    f.settings({f.INITIAL_WINDOW_SIZE: 1000}),  # a second ack
                    f.frame(f.PING, 0, 0, b"\x01\x02\x03\x04\x05\x06\x07\x08"))
        return await client.until(lambda fr: fr.kind == f.PING)

    frames = serve({}, scenario)
    pings = [fr for fr in frames if fr.kind == f.PING]
    assert len(pings) == 1
    assert pings[0].flags & f.ACK and pings[0].payload == b"\x01\x02\x03\x04\x05\x06\x07\x08"
    acks = [fr for fr in frames if fr.kind == f.SETTINGS and fr.flags & f.ACK]
    assert len(acks) == 2 and all(fr.payload == b"" for fr in acks)


# ---- 12 ----

def test_continuation_frames_are_joined_and_an_interrupted_block_is_an_error():
    async def scenario(h: Harness):
        client = await h.connect()
        block = client.block(ECHO)
        a, b = len(block) // 3, 2 * len(block) // 3
        client.send(f.frame(f.HEADERS, 0, 1, block[:a]),
                    f.frame(f.CONTINUATION, 0, 1, block[a:b]),
                    f.frame(f.CONTINUATION, f.END_HEADERS, 1, block[b:]),
                    f.frame(f.DATA, f.END_STREAM, 1, message(b"split")))
        split = await client.response(1)

        broken = await h.connect()
        block = broken.block(ECHO)
        broken.send(f.frame(f.HEADERS, 0, 1, block[:4]),
                    f.frame(f.PING, 0, 0, b"12345678"),
                    f.frame(f.CONTINUATION, f.END_HEADERS, 1, block[4:]))
        return split, await broken.closed()

    split, frames = serve(echo_methods(), scenario)
    assert split.status == OK and split.data == message(b"split")
    assert not [fr for fr in frames if fr.kind == f.PING]  # the PING was the error
    assert frames[-1].kind == f.GOAWAY and frames[-1].code == f.PROTOCOL_ERROR


# ---- 13 ----

def test_connection_without_preface_is_closed_after_the_timeout():
    async def scenario(h: Harness):
        start = time.monotonic()
        client = await h.connect(preface=False)
        await client.closed(timeout=2.0)
        return time.monotonic() - start

    elapsed = serve({}, scenario, limits=Limits(preface_timeout_s=0.3))
    assert 0.25 <= elapsed < 1.0


# ---- 14 ----

def test_authorize_false_gives_unauthenticated_without_running_the_handler():
    ran, asked = [], []

    async def record(request, context):
        ran.append(request)
        return request

    def authorize(path, metadata):
        asked.append(path)
        return ("authorization", "Bearer ok") in metadata

    async def scenario(h: Harness):
        client = await h.connect()
        client.send(client.call(1, RECORD, b"no token"))
        denied = await client.response(1)
        client.send(client.call(3, RECORD, b"token", extra=[("authorization", "Bearer ok")]))
        return denied, await client.response(3)

    denied, allowed = serve({RECORD: Method("unary", record, raw, raw)}, scenario,
                            authorize=authorize)
    assert denied.status == UNAUTHENTICATED and f.DATA not in denied.kinds
    assert allowed.status == OK  # the check can pass: it is the token that decides
    assert ran == [b"token"] and asked == [RECORD, RECORD]


# ---- 15 ----

def kernel_send_buffer_max() -> int:
    """The most a TCP socket's send buffer grows to by itself here (Linux autotuning)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as fh:
            return int(fh.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 4 * 1024 * 1024


# A handler that writes in a loop without awaiting anything else must pause too: the
# connection flushes and yields once write_buffer_high bytes wait in it (this case failed
# before: every frame piled up in the connection until the client's 2^31-1 window ran out).
@pytest.mark.parametrize("yield_between_writes", [True, False])
def test_a_client_that_stops_reading_pauses_the_writers(yield_between_writes):
    high, big = 64 * 1024, b"z" * 65536
    # What may legitimately be written before the writers pause: the kernel's buffers (the
    # server's send buffer autotunes up to tcp_wmem's max; the client's receive buffer is
    # tiny), the transport's buffer up to `high`, and a message or two in flight.
    bound = (kernel_send_buffer_max() + 1024 * 1024) // len(big)
    cap = 4 * bound  # only keeps a broken server from buffering 2 GiB
    writes = [0]

    async def flood(request, context):
        while writes[0] < cap:
            await context.write(big)
            writes[0] += 1
            if yield_between_writes:
                await asyncio.sleep(0)

    async def scenario(h: Harness):
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", h.port))
        client = await h.connect(sock=sock, preface=False)
        client.send(f.PREFACE, f.settings({f.INITIAL_WINDOW_SIZE: f.MAX_WINDOW}),
                    f.window_update(0, f.MAX_WINDOW - f.DEFAULT_WINDOW),
                    client.call(1, STREAM, b""))
        client.writer.transport.pause_reading()  # from now on the client reads nothing
        await asyncio.sleep(1.0)
        first = writes[0]
        await asyncio.sleep(0.5)
        (conn,) = h.server.connections
        return first, writes[0], conn.transport.get_write_buffer_size()

    first, second, buffered = serve({STREAM: Method("stream", flood, raw, raw)}, scenario,
                                    limits=Limits(write_buffer_high=high))
    assert first == second, "the handler kept writing to a client that reads nothing"
    assert 0 < first <= bound, f"{first} x 64 KiB written before the connection paused"
    assert buffered <= high + 2 * len(big), f"{buffered} bytes buffered in the server process"
