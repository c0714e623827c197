"""EngineLoop: the one thread that owns an engine; every other thread talks to it by command.

    loop = EngineLoop("decode-loop", step, on_error)   # the thread starts at once
    loop.call(lambda: engine.add_request(...))         # runs between two steps, returns its value
    future = loop.submit(fn)                           # the same, without waiting
    loop.stop(last)                                    # `last` is the final command

Commands run on the loop thread in the order they were submitted, between steps; `step()`
runs after them and says whether it did any work: when it did not, the loop waits for the
next command (at most `idle_wait_s`, so a step that polls something, e.g. KV transfers,
still runs that often). A command that raises fails only its own future. A step that raises
kills the loop: every queued command fails with the reason, `on_error(exc)` runs on the loop
thread so the owner can fail its own callers and streams, and any later call raises
`LoopClosedError` at once instead of hanging.

Even an idle loop wakes at least every `MAX_IDLE_WAIT_S`, and every iteration records its
time (`seconds_since_beat`): an owner tells an idle loop from a wedged one (a step or command
that never returns) by how long ago the loop last came round.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005
MAX_IDLE_WAIT_S = 0.5  # an idle loop still comes round this often (its heartbeat)
JOIN_S = 30.0

T = TypeVar("T")


class LoopClosedError(RuntimeError):
    """The loop was stopped, or died (the message says which, and why)."""


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: Future
    last: bool = False  # the loop ends after it


class EngineLoop:
    def __init__(
        self,
        name: str,
        step: Callable[[], bool],
        on_error: Callable[[BaseException], None] | None = None,
        idle_wait_s: float | None = IDLE_WAIT_S,
    ) -> None:
        """`idle_wait_s` None: an idle loop waits for the next command (waking every
        MAX_IDLE_WAIT_S to beat)."""
        self.name = name
        self.error: BaseException | None = None  # what killed the loop
        self._step, self._on_error, self._idle_wait_s = step, on_error, idle_wait_s
        self._queue: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submits against closing
        self._closed: str | None = None  # why no command is accepted any more
        self._stopping = False
        self._beat = time.monotonic()  # when the loop last came round
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn`; its future gives its value or its exception. Raises LoopClosedError."""
        return self._put(_Command(fn, Future()))

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the loop thread and return its value (or raise its exception)."""
        return self.submit(fn).result()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def seconds_since_beat(self) -> float:
        """How long since the loop last came round (idle or not): large = wedged."""
        return time.monotonic() - self._beat

    def join(self, timeout_s: float = JOIN_S) -> bool:
        """Wait for the thread to end (after it stopped or died); whether it has."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self, last: Callable[[], None] | None = None) -> bool:
        """Run `last` as the final command and end the thread; idempotent. False when the
        loop had already stopped or died, so `last` did not run (the caller may release what
        the loop held itself: no other thread touches it any more)."""
        try:
            future = self._put(_Command(last or _nothing, Future(), last=True))
        except LoopClosedError:
            self._thread.join(JOIN_S)
            return False
        try:
            future.result()
        except LoopClosedError:  # it died before reaching `last`
            return False
        finally:
            self._thread.join(JOIN_S)
        return True

    def _put(self, command: _Command) -> Future:
        with self._lock:
            if self._closed is not None:
                raise LoopClosedError(self._closed)
            if command.last:
                self._closed = f"{self.name} is closed"
            self._queue.put(command)
        return command.future

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._beat = time.monotonic()
                self._run_commands()
                if self._stopping:
                    break
                if not self._step() and not self._stopping:
                    self._wait_for_command()
        except BaseException as exc:  # noqa: BLE001 - every waiting caller learns the reason
            logger.exception("%s died", self.name)
            self._die(exc)
        finally:
            with self._lock:
                self._closed = self._closed or f"{self.name} is closed"
            self._fail_queued()

    def _run_commands(self) -> None:
        while not self._stopping:
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                return
            self._execute(command)

    def _wait_for_command(self) -> None:
        try:
            wait = self._idle_wait_s
            command = self._queue.get(timeout=MAX_IDLE_WAIT_S if wait is None
                                      else min(wait, MAX_IDLE_WAIT_S))
        except queue.Empty:
            return
        self._execute(command)

    def _execute(self, command: _Command) -> None:
        self._beat = time.monotonic()  # a command may block: it counts from its start
        try:
            command.future.set_result(command.fn())
        except BaseException as exc:  # noqa: BLE001 - the caller gets it, the loop goes on
            command.future.set_exception(exc)
        finally:
            self._stopping = self._stopping or command.last

    def _die(self, exc: BaseException) -> None:
        self.error = exc
        with self._lock:
            self._closed = f"{self.name} died: {type(exc).__name__}: {exc}"
        self._fail_queued()
        if self._on_error is not None:
            try:
                self._on_error(exc)
            except Exception:  # noqa: BLE001 - already failing; keep the first reason
                logger.exception("%s: failing its callers failed too", self.name)

    def _fail_queued(self) -> None:
        """Once closed (nothing more is queued): fail whatever still waits in the queue."""
        while True:
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                return
            command.future.set_exception(LoopClosedError(self._closed))


def _nothing() -> None:
    """The final command of a loop stopped without one."""
