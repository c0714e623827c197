"""EngineLoop: commands between steps, futures for calls, idle wait, death and shutdown."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.engine.loop import EngineLoop, LoopClosedError


class Counter:
    """A fake engine: `pending` units of work, one per step."""

    def __init__(self) -> None:
        self.pending = 0
        self.steps = 0
        self.thread: threading.Thread | None = None

    def step(self) -> bool:
        self.thread = threading.current_thread()
        if not self.pending:
            return False
        self.pending -= 1
        self.steps += 1
        return True


def test_commands_run_on_the_loop_thread_in_order_between_steps():
    engine = Counter()
    loop = EngineLoop("test-loop", engine.step)
    seen = []
    futures = [loop.submit(lambda i=i: seen.append((i, threading.current_thread()))) for i in
               range(5)]
    for f in futures:
        f.result(timeout=5)
    assert [i for i, _ in seen] == list(range(5))
    assert all(t is loop._thread for _, t in seen)
    assert loop.call(lambda: setattr(engine, "pending", 3) or "queued") == "queued"
    deadline = time.monotonic() + 5
    while engine.steps < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.steps == 3 and engine.thread is loop._thread
    assert loop.stop()


def test_a_failing_command_fails_only_its_caller():
    loop = EngineLoop("test-loop", Counter().step)
    with pytest.raises(ValueError, match="bad input"):
        loop.call(lambda: (_ for _ in ()).throw(ValueError("bad input")))
    assert loop.call(lambda: 42) == 42 and loop.is_alive()
    loop.stop()


def test_an_idle_loop_without_a_wait_sleeps_until_a_command():
    engine = Counter()
    loop = EngineLoop("test-loop", engine.step, idle_wait_s=None)
    time.sleep(0.05)
    assert loop.call(lambda: 1) == 1  # woke for the command, at once
    assert loop.stop()
    assert not loop.is_alive()


def test_stop_runs_the_last_command_and_refuses_later_calls():
    ran = []
    loop = EngineLoop("test-loop", Counter().step)
    assert loop.stop(lambda: ran.append(threading.current_thread().name))
    assert ran == ["test-loop"] and not loop.is_alive()
    with pytest.raises(LoopClosedError, match="is closed"):
        loop.call(lambda: 1)
    assert not loop.stop(lambda: ran.append("again"))  # idempotent; nothing more runs
    assert ran == ["test-loop"]


def test_a_dying_loop_fails_waiting_callers_and_tells_its_owner():
    errors, entered, release = [], threading.Event(), threading.Event()

    def step() -> bool:
        entered.set()
        release.wait(5)
        raise RuntimeError("boom")

    loop = EngineLoop("test-loop", step, errors.append)
    assert entered.wait(5)
    queued = loop.submit(lambda: "never runs")  # waits behind the step that will raise
    release.set()
    with pytest.raises(LoopClosedError, match="died: RuntimeError: boom"):
        queued.result(timeout=5)
    loop._thread.join(5)
    assert [str(e) for e in errors] == ["boom"] and str(loop.error) == "boom"
    with pytest.raises(LoopClosedError, match="boom"):  # at once, not a hang
        loop.call(lambda: 1)
    assert not loop.stop(lambda: None)
