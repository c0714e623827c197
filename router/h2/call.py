"""Call: one gRPC call on one HTTP/2 stream, and the `context` its handler is given.

The handler sees the part of grpc.aio's ServicerContext the router's servicers use:
`invocation_metadata()`, `await write(message)`, `await abort(code, details)`, `cancelled()`
and `done()`. A write returns at once while the stream's and the connection's flow-control
windows have room (the frame joins the connection's next flush); it waits only when the
client reads slower than the call writes, which is when the router's mailbox merges tokens.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import grpc

MESSAGE_PREFIX = 5  # compressed flag + 4-byte big-endian length


class AbortError(Exception):
    """Raised by `abort`: the status went out; the handler ends."""


class CallEnded(Exception):
    """A write to a call that already ended (the client reset it, or it was aborted)."""


def grpc_message(details: str, limit: int = 1024) -> bytes:
    """`grpc-message`: percent-encoded UTF-8 (gRPC's HTTP/2 spec), at most `limit` characters
    of the details so the trailers always fit one frame."""
    return "".join(chr(b) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}"
                   for b in details[:limit].encode()).encode()


class Call:
    def __init__(self, conn, stream_id: int, method: str, metadata: tuple,
                 send_window: int, recv_window: int) -> None:
        self.conn, self.stream_id, self.method, self.metadata = conn, stream_id, method, metadata
        self.send_window, self.recv_window = send_window, recv_window
        self.unacked = 0  # bytes received and not yet given back in a WINDOW_UPDATE
        self.serialize: Callable[[object], bytes] = bytes
        self.body = bytearray()  # received bytes not yet cut into messages
        self.messages: deque[bytes] = deque()
        self.half_closed = False  # the client sent END_STREAM
        self.headers_sent = False
        self.ended = False  # trailers sent, or the stream reset
        self.reset_by_client = False
        self.expired = False  # the client's deadline passed
        self.task: asyncio.Task | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self._readable: asyncio.Future | None = None

    # ---- the handler's context ----

    def invocation_metadata(self) -> tuple:
        return self.metadata

    def cancelled(self) -> bool:
        return self.reset_by_client or self.expired

    def done(self) -> bool:
        return self.ended

    async def write(self, message) -> None:
        if self.ended:
            raise CallEnded(f"call {self.method} already ended")
        data = self.serialize(message)
        await self.conn.send_data(self, len(data).to_bytes(MESSAGE_PREFIX, "big") + data)

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        """As grpc.aio's: end the call with this status (and these ASCII trailers)."""
        self.finish(code, details, trailing_metadata)
        raise AbortError(details)

    # ---- the server's side ----

    def finish(self, code: grpc.StatusCode, details: str = "",
               trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        """Send the status (trailers) once; later calls do nothing."""
        if not self.ended:
            self.conn.send_trailers(self, code.value[0], details, trailing_metadata)

    def received(self, data: bytes, max_message: int) -> tuple[grpc.StatusCode, str] | None:
        """Take a DATA payload; whole messages join `messages`. The status to end the call with
        when the client sent something it refuses."""
        self.body += data
        body = self.body
        while len(body) >= MESSAGE_PREFIX:
            length = int.from_bytes(body[1:MESSAGE_PREFIX], "big")
            if body[0]:
                return (grpc.StatusCode.UNIMPLEMENTED,
                        "compressed messages are not supported (send grpc-encoding identity)")
            if length > max_message:
                return (grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"request message of {length} bytes is over the {max_message}-byte limit")
            if len(body) < MESSAGE_PREFIX + length:
                break
            self.messages.append(bytes(body[MESSAGE_PREFIX:MESSAGE_PREFIX + length]))
            del body[:MESSAGE_PREFIX + length]
        self._wake()
        return None

    def close_input(self) -> None:
        self.half_closed = True
        self._wake()

    def _wake(self) -> None:
        if self._readable is not None and not self._readable.done():
            self._readable.set_result(None)

    async def read(self) -> bytes | None:
        """The next request message; None once the client half-closed with none left."""
        while not self.messages:
            if self.half_closed or self.ended:
                return None
            self._readable = asyncio.get_running_loop().create_future()
            await self._readable
        return self.messages.popleft()

    async def requests(self, parse: Callable[[bytes], object]):
        """The request stream of a client-streaming method."""
        while (data := await self.read()) is not None:
            yield parse(data)
