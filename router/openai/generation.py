"""One OpenAI generation call, run as an ASGI response while the client stays connected.

The work (admission, placement, streaming) happens inside the response, raced against the
client's disconnect: a client that goes away cancels it, and cancelling the router's streams
frees every KV block their requests held, on every worker. A non-streamed answer, and the
status of a streamed one, are sent only once the outcome is known, so admission and placement
errors keep their HTTP status (429, 503, ...) even when `stream` is true; an error after the
first event is sent as an `error` event before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve.proto import pdserve_pb2
from pdserve.router.openai.errors import error_body, status_of
from pdserve.router.openai.protocol import OpenAIRequest
from pdserve.router.openai.responses import Choices

logger = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Any]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class ChoiceStreams:
    """The router streams of every choice, merged; the owner of their tasks."""

    def __init__(self, streams: list[AsyncIterator[pdserve_pb2.GenerateResponse]]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(streams)
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, stream: AsyncIterator) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for message in stream:
                    self._queue.put_nowait((index, message))
            self._queue.put_nowait((index, None))
        except Exception as exc:
            self._queue.put_nowait((index, exc))

    async def next(self) -> tuple[int, pdserve_pb2.GenerateResponse] | None:
        """The next message of any choice; None once every choice has finished."""
        while self._open:
            index, item = await self._queue.get()
            if item is None:
                self._open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return index, item
        return None

    async def close(self) -> None:
        """Cancel what still runs (the router frees those requests) and wait for it."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class GenerationResponse:
    """ASGI response: run `request` on the router, answer as JSON or Server-Sent Events."""

    def __init__(self, request: OpenAIRequest, open_streams: Callable[[], list[AsyncIterator]],
                 choices: Choices, timeout_s: float, on_done: Callable[[str], None]) -> None:
        self.request, self.open_streams, self.choices = request, open_streams, choices
        self.timeout_s, self.on_done = timeout_s, on_done
        self.started = False  # the status line is sent
        self.completed = False  # the last byte is sent

    async def __call__(self, scope: dict, receive: Callable, send: Send) -> None:
        work = asyncio.ensure_future(self._run(send))
        watch = asyncio.ensure_future(_disconnect(receive))
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        # The server reports a disconnect once the last byte is sent, too: only one before
        # that is the client going away.
        if not work.done() and not self.completed:
            logger.info("client of %s disconnected: cancelling", self.request.response_id)
            work.cancel()
        watch.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
        if work.done() and not work.cancelled() and work.exception() is not None:
            raise work.exception()

    async def _run(self, send: Send) -> None:
        status = "error"
        streams = ChoiceStreams(self.open_streams())
        try:
            answer = self._stream if self.request.stream else self._whole
            await asyncio.wait_for(answer(send, streams), self.timeout_s)
            status = "ok"
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except Exception as exc:
            code, kind = status_of(exc)
            status = kind
            if code == 500:
                logger.exception("OpenAI request %s failed", self.request.response_id)
            await self._fail(send, code, exc)
        finally:
            await streams.close()
            self.on_done(status)

    async def _whole(self, send: Send, streams: ChoiceStreams) -> None:
        while (item := await streams.next()) is not None:
            self.choices.add(*item)
        await self._send_json(send, 200, self.choices.response())

    async def _stream(self, send: Send, streams: ChoiceStreams) -> None:
        item = await streams.next()  # errors before the first token keep their status
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        self.started = True
        for chunk in self.choices.first_chunks():
            await _event(send, chunk)
        while item is not None:
            chunk = self.choices.add(*item)
            if chunk is not None:
                await _event(send, chunk)
            item = await streams.next()
        if self.request.include_usage:
            await _event(send, self.choices.usage_chunk())
        await self._done(send)

    async def _fail(self, send: Send, code: int, exc: BaseException) -> None:
        body = error_body(code, exc)
        if not self.started:
            await self._send_json(send, code, body)
            return
        await _event(send, body)
        await self._done(send)

    async def _send_json(self, send: Send, status: int, body: dict[str, Any]) -> None:
        self.completed = True  # set first: the disconnect that follows the send is no cancel
        await send_json(send, status, body)

    async def _done(self, send: Send) -> None:
        self.completed = True
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def _event(send: Send, chunk: dict[str, Any]) -> None:
    data = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _disconnect(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
