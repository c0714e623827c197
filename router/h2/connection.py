"""Connection: the server side of one HTTP/2 connection carrying gRPC calls (RFC 9113).

Frames are parsed as they arrive; each new stream becomes a Call whose handler the server
runs as a task. Everything written in one event-loop cycle (every stream's messages, window
updates, acks) leaves in one socket write at the end of the cycle.

What a client cannot do to it: make it buffer without bound (when the client stops reading,
the connection stops reading it too, so pings, settings and new streams wait in the kernel);
open more than `max_streams` calls at once (REFUSED_STREAM); send a header block over
`max_header_block` bytes, a message over `max_message` bytes, a frame over 16 KiB, or
compressed messages; reset streams faster than `resets_per_s` (GOAWAY ENHANCE_YOUR_CALM, the
HTTP/2 rapid-reset attack); hold a connection open without a preface for more than
`preface_timeout_s`. Any protocol error ends the connection with GOAWAY naming it.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.router.h2 import frames as f
from pdserve.router.h2.call import Call, CallEnded, grpc_message
from pdserve.router.h2.inbound import Inbound
from pdserve.router.h2.limits import Limits

logger = logging.getLogger(__name__)


class Connection(asyncio.Protocol):
    def __init__(self, server, limits: Limits) -> None:
        self.server, self.limits = server, limits
        self.transport: asyncio.Transport | None = None
        self.calls: dict[int, Call] = {}
        self.last_stream_id = 0
        self.closed = self.going_away = False
        self.inbound = Inbound(self, limits)
        self.peer_window = f.DEFAULT_WINDOW  # the client's initial stream window
        self.peer_frame = f.DEFAULT_FRAME_SIZE
        self.send_window = f.DEFAULT_WINDOW  # connection-level, for our DATA
        self._out: list[bytes] = []
        self._queued = 0  # bytes in _out
        self._blocked: list[asyncio.Future] = []  # writers waiting for window or buffer room
        self._paused = False

    # ---- asyncio.Protocol ----

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=self.limits.write_buffer_high)
        self.send(f.settings({f.MAX_CONCURRENT_STREAMS: self.limits.max_streams,
                              f.INITIAL_WINDOW_SIZE: self.limits.recv_window,
                              f.MAX_HEADER_LIST_SIZE: self.limits.max_header_list,
                              f.ENABLE_PUSH: 0}))
        self.send(f.window_update(0, self.limits.recv_window))
        asyncio.get_running_loop().call_later(self.limits.preface_timeout_s, self._check_preface)
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.inbound.buf += data
        try:
            self.inbound.parse()
        except f.H2Error as exc:
            self.close(exc.code, str(exc))
        except Exception:  # a bug of ours: this connection ends, the server goes on
            logger.exception("HTTP/2 connection failed")
            self.close(f.INTERNAL_ERROR, "internal error")

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            self.end(call, reset_by_client=True)
        self.wake()

    def pause_writing(self) -> None:  # the client stopped reading: stop reading it too
        self._paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if not self.closed:
            self.transport.resume_reading()
        self.wake()

    # ---- writing ----

    def send(self, data: bytes) -> None:
        if self.closed:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(data)
        self._queued += len(data)

    def _flush(self) -> None:
        out, self._out, self._queued = self._out, [], 0
        if not self.closed and out:
            self.transport.write(b"".join(out))

    def wake(self) -> None:
        blocked, self._blocked = self._blocked, []
        for waiter in blocked:
            if not waiter.done():
                waiter.set_result(None)

    async def send_data(self, call: Call, payload: bytes) -> None:
        """One gRPC message as DATA frames, within both flow-control windows."""
        if not call.headers_sent:
            self._send_headers(call)
        while payload:
            if call.ended or self.closed:
                raise CallEnded(f"call {call.method} already ended")
            if self._queued >= self.limits.write_buffer_high:  # a writer that never awaits:
                self._flush()  # hand the socket what it has (pause_writing may follow) and
                await asyncio.sleep(0)  # let the loop run
            n = min(len(payload), call.send_window, self.send_window, self.peer_frame)
            if n <= 0 or self._paused:
                waiter = asyncio.get_running_loop().create_future()
                self._blocked.append(waiter)
                await waiter
                continue
            call.send_window -= n
            self.send_window -= n
            self.send(f.frame(f.DATA, 0, call.stream_id, payload[:n]))
            payload = payload[n:]

    def _send_headers(self, call: Call, trailers: bytes = b"", end: bool = False) -> None:
        block = f.STATUS_200 + CONTENT_TYPE + trailers
        call.headers_sent = True
        self.send(f.frame(f.HEADERS, f.END_HEADERS | (f.END_STREAM if end else 0),
                          call.stream_id, block))

    def send_trailers(self, call: Call, code: int, details: str,
                      metadata: tuple[tuple[str, str], ...] = ()) -> None:
        block = f.literal(b"grpc-status", str(code).encode())
        if details:
            block += f.literal(b"grpc-message", grpc_message(details))
        for key, value in metadata:  # the server's own ASCII trailers (e.g. retry pushback)
            block += f.literal(key.lower().encode("ascii"), value.encode("ascii"))
        if call.headers_sent:  # else a trailers-only response
            self.send(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, call.stream_id, block))
        else:
            self._send_headers(call, block, end=True)
        if not call.half_closed:  # the client may stop sending (RFC 9113 8.1)
            self.send(f.rst_stream(call.stream_id, f.NO_ERROR))
        self.end(call)

    def end(self, call: Call, reset_by_client: bool = False) -> None:
        """The stream is closed: forget it. Closed by the client (a reset, or the connection
        lost), a handler still running is cancelled."""
        if call.ended:
            return
        call.ended = True
        call.reset_by_client = reset_by_client
        self.calls.pop(call.stream_id, None)
        call.close_input()
        if call.deadline is not None:
            call.deadline.cancel()
        if reset_by_client and call.task is not None:
            call.task.cancel()
        self.wake()
        if self.going_away and not self.calls:
            self.close(f.NO_ERROR, "")

    def close(self, code: int, reason: str) -> None:
        """GOAWAY with `code`, then close once it is written."""
        if self.closed:
            return
        if code != f.NO_ERROR:
            logger.info("closing an HTTP/2 connection: %s", reason)
        self.send(f.goaway(self.last_stream_id, code, reason.encode()[:256]))
        self._flush()
        self.closed = True
        self.transport.close()

    def go_away(self) -> None:
        """Refuse new streams; close once the running ones have ended."""
        self.going_away = True
        self.send(f.goaway(self.last_stream_id, f.NO_ERROR))
        if not self.calls:
            self.close(f.NO_ERROR, "")

    def _check_preface(self) -> None:
        if not self.inbound.preface and not self.closed:
            self.closed = True
            self.transport.close()

    def new_call(self, stream_id: int, method: str, metadata: tuple) -> Call:
        call = Call(self, stream_id, method, metadata, self.peer_window, self.limits.recv_window)
        self.calls[stream_id] = call
        return call


CONTENT_TYPE = f.literal(b"content-type", b"application/grpc")
