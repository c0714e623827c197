"""Inbound: the frames a client sends on one HTTP/2 connection, parsed and acted on.

Owns what only reading needs: the bytes not yet parsed, whether the preface came, the HPACK
decoder (its dynamic table is the client's), a header block still waiting for its
CONTINUATION frames, the unacknowledged received bytes and the reset budget. Streams, windows
and writing belong to the Connection.
"""

from __future__ import annotations

import time

import hpack

from pdserve.router.h2 import frames as f
from pdserve.router.h2.limits import Limits


class Inbound:
    def __init__(self, conn, limits: Limits) -> None:
        self.conn, self.limits = conn, limits
        self.buf = bytearray()
        self._preface = False
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = limits.max_header_list
        self._block: tuple[int, int, bytearray] | None = None  # (stream, flags, fragments)
        self._unacked = 0  # connection-level bytes received, not yet given back
        self._resets, self._reset_at = float(limits.reset_burst), time.monotonic()

    @property
    def preface(self) -> bool:
        return self._preface

    def parse(self) -> None:
        buf = self.buf
        if not self._preface:
            if len(buf) < len(f.PREFACE):
                if not f.PREFACE.startswith(bytes(buf)):
                    raise f.H2Error(f.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return
            if buf[:len(f.PREFACE)] != f.PREFACE:
                raise f.H2Error(f.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            del buf[:len(f.PREFACE)]
            self._preface = True
        at = 0
        while len(buf) - at >= 9 and not self.conn.closed:
            length, kind, flags, stream_id = f.parse_header(buf, at)
            if length > f.DEFAULT_FRAME_SIZE:
                raise f.H2Error(f.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            if len(buf) - at - 9 < length:
                break
            payload = bytes(buf[at + 9:at + 9 + length])
            at += 9 + length
            if self._block is not None and kind != f.CONTINUATION:
                raise f.H2Error(f.PROTOCOL_ERROR, "a header block was interrupted")
            handler = _HANDLERS.get(kind)
            if handler is not None:  # unknown frame types are ignored (RFC 9113 5.5)
                handler(self, flags, stream_id, payload)
        del buf[:at]

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise f.H2Error(f.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        self._unacked += size
        if self._unacked >= self.limits.recv_window // 2:
            self.conn.send(f.window_update(0, self._unacked))
            self._unacked = 0
        call = self.conn.calls.get(stream_id)
        if call is None:
            if stream_id > self.conn.last_stream_id:
                raise f.H2Error(f.PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            return  # a stream we already closed: ignored
        if call.half_closed:
            raise f.H2Error(f.STREAM_CLOSED, f"DATA after END_STREAM on stream {stream_id}")
        call.recv_window -= size
        if call.recv_window < 0:
            raise f.H2Error(f.FLOW_CONTROL_ERROR, f"stream {stream_id} overran its window")
        call.unacked += size
        if call.unacked >= self.limits.recv_window // 2 and not flags & f.END_STREAM:
            self.conn.send(f.window_update(stream_id, call.unacked))
            call.recv_window += call.unacked
            call.unacked = 0
        error = call.received(_unpad(flags, payload), self.limits.max_message)
        if error is not None:
            call.finish(*error)
            if call.task is not None:
                call.task.cancel()
        elif flags & f.END_STREAM:
            call.close_input()

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise f.H2Error(f.PROTOCOL_ERROR, "HEADERS on stream 0")
        payload = _unpad(flags, payload)
        if flags & f.PRIORITY_FLAG:
            payload = payload[5:]
        self._block = (stream_id, flags, bytearray(payload))
        self._on_block_part()

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is None or self._block[0] != stream_id:
            raise f.H2Error(f.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        self._block[2].extend(payload)
        self._block = (stream_id, self._block[1] | (flags & f.END_HEADERS), self._block[2])
        self._on_block_part()

    def _on_block_part(self) -> None:
        stream_id, flags, block = self._block
        if len(block) > self.limits.max_header_block:
            raise f.H2Error(f.ENHANCE_YOUR_CALM, "header block too large")
        if not flags & f.END_HEADERS:
            return
        self._block = None
        try:
            headers = self._decoder.decode(bytes(block), raw=True)
        except (hpack.HPACKError, ValueError, IndexError) as exc:
            raise f.H2Error(f.COMPRESSION_ERROR, f"header block: {exc}") from None
        call = self.conn.calls.get(stream_id)
        if call is not None:  # trailers from the client end its input
            if not flags & f.END_STREAM:
                raise f.H2Error(f.PROTOCOL_ERROR, "trailers without END_STREAM")
            call.close_input()
            return
        if stream_id % 2 == 0 or stream_id <= self.conn.last_stream_id:
            raise f.H2Error(f.PROTOCOL_ERROR, f"HEADERS opening stream {stream_id}")
        self.conn.last_stream_id = stream_id
        if self.conn.going_away or len(self.conn.calls) >= self.limits.max_streams:
            self.conn.send(f.rst_stream(stream_id, f.REFUSED_STREAM))
            return
        self.conn.server.open_call(self.conn, stream_id, headers, bool(flags & f.END_STREAM))

    def _on_rst_stream(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or len(payload) != 4:
            raise f.H2Error(f.PROTOCOL_ERROR, "malformed RST_STREAM")
        call = self.conn.calls.get(stream_id)
        if call is None:
            if stream_id > self.conn.last_stream_id:
                raise f.H2Error(f.PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
            return
        now = time.monotonic()
        self._resets = min(self.limits.reset_burst,
                           self._resets + (now - self._reset_at) * self.limits.resets_per_s) - 1
        self._reset_at = now
        self.conn.end(call, reset_by_client=True)
        if self._resets < 0:
            raise f.H2Error(f.ENHANCE_YOUR_CALM, "too many streams reset")

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise f.H2Error(f.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & f.ACK:
            if payload:
                raise f.H2Error(f.FRAME_SIZE_ERROR, "SETTINGS ack with a payload")
            return
        for key, value in f.parse_settings(payload):
            if key == f.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise f.H2Error(f.FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                for call in self.conn.calls.values():
                    call.send_window += value - self.conn.peer_window
                self.conn.peer_window = value
            elif key == f.MAX_FRAME_SIZE:
                if not f.DEFAULT_FRAME_SIZE <= value <= 2**24 - 1:
                    raise f.H2Error(f.PROTOCOL_ERROR, f"max frame size {value}")
                self.conn.peer_frame = value
            elif key == f.ENABLE_PUSH and value > 1:
                raise f.H2Error(f.PROTOCOL_ERROR, f"enable push {value}")
        self.conn.send(f.frame(f.SETTINGS, f.ACK, 0))
        self.conn.wake()

    def _on_ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0 or len(payload) != 8:
            raise f.H2Error(f.FRAME_SIZE_ERROR if len(payload) != 8 else f.PROTOCOL_ERROR,
                            "malformed PING")
        if not flags & f.ACK:
            self.conn.send(f.frame(f.PING, f.ACK, 0, payload))

    def _on_goaway(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise f.H2Error(f.PROTOCOL_ERROR, "GOAWAY on a stream")
        self.conn.going_away = True  # the client opens no more streams; running ones go on
        if not self.conn.calls:
            self.conn.close(f.NO_ERROR, "")

    def _on_window_update(self, flags: int, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise f.H2Error(f.FRAME_SIZE_ERROR, "malformed WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & f.MAX_WINDOW
        if stream_id == 0:
            if increment == 0:
                raise f.H2Error(f.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.conn.send_window += increment
            if self.conn.send_window > f.MAX_WINDOW:
                raise f.H2Error(f.FLOW_CONTROL_ERROR, "connection window over 2^31-1")
        elif stream_id > self.conn.last_stream_id:
            raise f.H2Error(f.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {stream_id}")
        elif (call := self.conn.calls.get(stream_id)) is not None:
            if increment == 0 or call.send_window + increment > f.MAX_WINDOW:
                self.conn.send(f.rst_stream(stream_id, f.FLOW_CONTROL_ERROR if increment
                                       else f.PROTOCOL_ERROR))
                self.conn.end(call, reset_by_client=True)
                return
            call.send_window += increment
        self.conn.wake()

    def _on_priority(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise f.H2Error(f.PROTOCOL_ERROR, "PRIORITY on stream 0")
        if len(payload) != 5:
            raise f.H2Error(f.FRAME_SIZE_ERROR, "malformed PRIORITY")

    def _on_push_promise(self, flags: int, stream_id: int, payload: bytes) -> None:
        raise f.H2Error(f.PROTOCOL_ERROR, "PUSH_PROMISE from a client")


def _unpad(flags: int, payload: bytes) -> bytes:
    if not flags & f.PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise f.H2Error(f.PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1:len(payload) - payload[0]]


_HANDLERS = {
    f.DATA: Inbound._on_data, f.HEADERS: Inbound._on_headers,
    f.PRIORITY: Inbound._on_priority, f.RST_STREAM: Inbound._on_rst_stream,
    f.SETTINGS: Inbound._on_settings, f.PUSH_PROMISE: Inbound._on_push_promise,
    f.PING: Inbound._on_ping, f.GOAWAY: Inbound._on_goaway,
    f.WINDOW_UPDATE: Inbound._on_window_update, f.CONTINUATION: Inbound._on_continuation,
}
