"""AsyncLLMEngine: the engine on its own loop thread, one asyncio stream per request.

Requests are validated on the caller's event loop (ValueError before anything is queued),
then added and aborted by command on the engine's loop thread (engine.loop), which is the
only thread that touches the engine; it steps while requests are unfinished (torch releases
the GIL, so the event loop stays responsive) and hands each output to its request's asyncio
queue through `call_soon_threadsafe`. Leaving a stream early (break, cancel, exception)
aborts the request. A loop that dies ends every stream with its exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

from pdserve.engine.input_processor import Prompt
from pdserve.engine.llm_engine import LLMEngine, PreparedRequest
from pdserve.engine.loop import EngineLoop, LoopClosedError
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Item = RequestOutput | BaseException


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._streams: dict[str, asyncio.Queue[Item]] = {}  # touched on the event loop only
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._loop = EngineLoop("engine-loop", self._step, self._fail_all, idle_wait_s=None)

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Validate now (ValueError on bad input), queue, and return the output stream."""
        if self._loop.error is not None:
            raise RuntimeError("engine loop has died") from self._loop.error
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        prepared = self.engine.prepare(request_id, prompt, params)
        self._event_loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._loop.submit(lambda: self._add(prepared))
        self._streams[request_id] = queue
        return self._stream(request_id, queue)

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str = ""
    ) -> AsyncIterator[RequestOutput]:
        """Per-step outputs of one request; the last one has `finished` set."""
        async for out in self.add_request(request_id or uuid.uuid4().hex, prompt, params):
            yield out

    def abort(self, request_id: str) -> None:
        """Abort at the next step boundary; its stream ends with finish_reason 'abort'."""
        if request_id in self._streams:
            with contextlib.suppress(LoopClosedError):  # stopped or dead: nothing runs now
                self._loop.submit(lambda: self._abort(request_id))

    async def shutdown(self) -> None:
        """Stop the loop thread (after the step it is in); the engine is the caller's again."""
        await asyncio.to_thread(self._loop.stop)

    async def _stream(self, request_id: str, queue: asyncio.Queue[Item]
                      ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    # ---- engine loop thread ----

    def _step(self) -> bool:
        if not self.engine.has_unfinished_requests():
            return False
        for out in self.engine.step():
            self._post(out.request_id, out)
        return True

    def _add(self, prepared: PreparedRequest) -> None:
        try:
            self.engine.add_prepared(prepared)
        except Exception as exc:  # its stream ends with the reason, the others go on
            self._post(prepared.request_id, exc)

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        if out is not None:  # None: it finished already, its last output is on its way
            self._post(request_id, out)

    def _post(self, request_id: str, item: Item) -> None:
        self._call_soon(self._deliver, request_id, item)

    def _fail_all(self, exc: BaseException) -> None:
        self._call_soon(self._end_streams, exc)

    def _call_soon(self, fn, *args) -> None:
        if self._event_loop is None:  # no stream was ever opened
            return
        try:
            self._event_loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody reads the streams any more
            logger.debug("event loop closed: %s dropped", fn.__name__)

    # ---- event loop ----

    def _end_streams(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for queue in streams.values():
            queue.put_nowait(exc)

    def _deliver(self, request_id: str, item: Item) -> None:
        queue = self._streams.get(request_id)
        if queue is None:
            return
        queue.put_nowait(item)
        if isinstance(item, BaseException) or item.finished:
            del self._streams[request_id]
