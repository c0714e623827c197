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
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve.proto import pdserve_pb2
from pdserve.router.mailbox import Mailbox
from pdserve.router.openai.errors import error_body, error_headers, status_of
from pdserve.router.openai.protocol import OpenAIRequest
from pdserve.router.openai.responses import Choices, dumps

logger = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Any]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class ChoiceStreams:
    """The router streams of every choice, merged; the owner of their tasks.

    A writer that fell behind (the client reads slower than tokens arrive: `send` waits on
    the socket's flow control) gets everything that arrived meanwhile at once, each choice's
    messages joined into one (see Mailbox), so it writes one event per choice, not one per
    token, and what waits is just those messages. A single choice (n = 1, nearly every
    request) is read straight from its router stream, no task between: that stream already
    merges whatever waited while the writer was busy (router/stream.py).
    """

    def __init__(self, streams: list[AsyncIterator[pdserve_pb2.GenerateResponse]]) -> None:
        self._mailbox = Mailbox()
        self._open = len(streams)
        self._error: Exception | None = None  # raised once the messages before it are out
        self._single = streams[0] if len(streams) == 1 else None
        self._tasks = [] if self._single is not None else [
            asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, stream: AsyncIterator) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for message in stream:
                    self._mailbox.put((index, message))
            self._mailbox.put((index, None))
        except Exception as exc:
            self._mailbox.put((index, exc))

    async def next(self) -> list[tuple[int, pdserve_pb2.GenerateResponse]]:
        """What arrived since the last call: (choice, message) with one message per choice;
        [] once every choice has finished."""
        if self._single is not None:
            message = await anext(self._single, None)
            return [] if message is None else [(0, message)]
        while self._open and self._error is None:
            arrived: dict[int, list[pdserve_pb2.GenerateResponse]] = {}
            for index, item in await self._mailbox.take():
                if item is None:
                    self._open -= 1
                elif isinstance(item, Exception):
                    self._error = item
                    break
                else:
                    arrived.setdefault(index, []).append(item)
            if arrived:
                return [(index, merge(messages)) for index, messages in arrived.items()]
        if self._error is not None:
            raise self._error
        return []

    async def close(self) -> None:
        """Cancel what still runs (the router frees those requests) and wait for it."""
        if self._single is not None:
            await self._single.aclose()
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
        while arrived := await streams.next():
            for index, message in arrived:
                self.choices.add(index, message)
        await self._send_json(send, 200, self.choices.response())

    async def _stream(self, send: Send, streams: ChoiceStreams) -> None:
        arrived = await streams.next()  # errors before the first token keep their status
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        self.started = True
        chunks = self.choices.first_chunks()
        while arrived:
            for index, message in arrived:
                if self.choices.reads(index):
                    chunks += self.choices.read_chunks(index, message)
                elif (chunk := self.choices.add_json(index, message)) is not None:
                    chunks.append(chunk)
            await _events(send, chunks)
            chunks, arrived = [], await streams.next()
        if self.request.include_usage:
            await _events(send, [self.choices.usage_chunk()])
        await self._done(send)

    async def _fail(self, send: Send, code: int, exc: BaseException) -> None:
        body = error_body(code, exc)
        if not self.started:
            await self._send_json(send, code, body, error_headers(exc))
            return
        await _events(send, [body])
        await self._done(send)

    async def _send_json(self, send: Send, status: int, body: dict[str, Any],
                         headers: list[tuple[bytes, bytes]] = ()) -> None:
        self.completed = True  # set first: the disconnect that follows the send is no cancel
        await send_json(send, status, body, headers)

    async def _done(self, send: Send) -> None:
        self.completed = True
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def send_json(send: Send, status: int, body: dict[str, Any],
                    headers: list[tuple[bytes, bytes]] = ()) -> None:
    data = dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *headers]})
    await send({"type": "http.response.body", "body": data})


async def _events(send: Send, chunks: list[dict[str, Any] | str]) -> None:
    """Server-Sent Events, one per chunk (a dict, or its JSON text already), in one write."""
    if not chunks:
        return
    data = "".join(f"data: {c if isinstance(c, str) else dumps(c)}\n\n" for c in chunks)
    await send({"type": "http.response.body", "body": data.encode(), "more_body": True})


def merge(messages: list[pdserve_pb2.GenerateResponse]) -> pdserve_pb2.GenerateResponse:
    """Consecutive messages of one choice as one: text, tokens and logprobs joined (and the
    first's prompt logprobs); finish, usage and timings of the last (only a last message
    carries them)."""
    if len(messages) == 1:
        return messages[0]
    merged = pdserve_pb2.GenerateResponse()
    merged.CopyFrom(messages[-1])
    merged.text = "".join(m.text for m in messages)
    del merged.token_ids[:], merged.logprobs[:], merged.prompt_logprobs[:]
    for m in messages:
        merged.token_ids.extend(m.token_ids)
        merged.logprobs.extend(m.logprobs)
        merged.prompt_logprobs.extend(m.prompt_logprobs)
    return merged


async def _disconnect(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
