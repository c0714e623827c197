"""AsyncLLMEngine: the engine loop in the background, one async stream per request.

Commands (add, abort) queue up and apply between steps, so the engine is only touched by
its loop; steps run in a single worker thread (torch releases the GIL) and the event loop
stays responsive. Leaving a stream early (break, cancel, exception) aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from pdserve.engine.input_processor import Prompt
from pdserve.engine.llm_engine import LLMEngine, PreparedRequest
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._adds: list[PreparedRequest] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._loop_task: asyncio.Task | None = None
        self._error: BaseException | None = None

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Validate now (ValueError on bad input), queue, and return the output stream."""
        if self._error is not None:
            raise RuntimeError("engine loop has died") from self._error
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        prepared = self.engine.prepare(request_id, prompt, params)
        self._streams[request_id] = asyncio.Queue()
        self._adds.append(prepared)
        self._ensure_loop()
        return self._stream(request_id)

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str = ""
    ) -> AsyncIterator[RequestOutput]:
        """Per-step outputs of one request; the last one has `finished` set."""
        async for out in self.add_request(request_id or uuid.uuid4().hex, prompt, params):
            yield out

    def abort(self, request_id: str) -> None:
        """Abort at the next step boundary; its stream ends with finish_reason 'abort'."""
        if request_id in self._streams:
            self._aborts.append(request_id)
            self._wake.set()

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def _stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        queue = self._streams[request_id]
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

    def _ensure_loop(self) -> None:
        self._wake.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
                for out in outputs:
                    self._deliver(out)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a dead loop must not leave streams hanging
            logger.exception("engine loop failed")
            self._error = exc
            for queue in self._streams.values():
                queue.put_nowait(exc)
            self._streams.clear()

    def _apply_commands(self) -> None:
        adds, self._adds = self._adds, []
        for prepared in adds:
            if prepared.request_id in self._streams:
                self.engine.add_prepared(prepared)
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            out = self.engine.abort(request_id)
            if out is not None:
                self._deliver(out)
            else:
                self._streams.pop(request_id, None)

    def _deliver(self, out: RequestOutput) -> None:
        queue = self._streams.get(out.request_id)
        if queue is None:
            return
        queue.put_nowait(out)
        if out.finished:
            del self._streams[out.request_id]

