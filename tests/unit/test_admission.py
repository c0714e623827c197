"""Admission: bounded in-flight slots, a bounded FIFO queue, no slot leaked on cancellation."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.admission import Admission, Overloaded, ShuttingDown


async def _settle() -> None:
    """Let every ready task run until it blocks again."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_constructor_validates():
    with pytest.raises(ValueError, match="max_inflight"):
        Admission(0, 1)
    with pytest.raises(ValueError, match="max_queued"):
        Admission(1, -1)
    Admission(1, 0)  # no queue at all is allowed


def test_immediate_admission_up_to_max_inflight():
    async def main() -> None:
        adm = Admission(max_inflight=2, max_queued=1)
        await asyncio.wait_for(adm.acquire(), 1)
        await asyncio.wait_for(adm.acquire(), 1)
        assert (adm.num_inflight, adm.num_queued) == (2, 0)
        adm.release()
        adm.release()
        assert adm.num_inflight == 0

    asyncio.run(main())


def test_release_wakes_the_next_waiter():
    async def main() -> None:
        adm = Admission(1, 2)
        await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await _settle()
        assert not waiter.done() and adm.num_queued == 1
        adm.release()
        await asyncio.wait_for(waiter, 1)
        assert (adm.num_inflight, adm.num_queued) == (1, 0)  # slot handed over, not freed
        adm.release()
        assert adm.num_inflight == 0

    asyncio.run(main())


def test_fifo_order_and_no_overtaking():
    async def main() -> None:
        adm = Admission(1, 10)
        order: list[int] = []

        async def user(i: int) -> None:
            async with adm.slot():
                order.append(i)
                await asyncio.sleep(0)

        await adm.acquire()
        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(user(i)))
            await _settle()  # each queues before the next arrives
        assert adm.num_queued == 5
        adm.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 2)
        assert order == [0, 1, 2, 3, 4]
        assert (adm.num_inflight, adm.num_queued) == (0, 0)

    asyncio.run(main())


def test_overloaded_when_queue_full():
    async def main() -> None:
        adm = Admission(1, 2)
        await adm.acquire()
        waiters = [asyncio.create_task(adm.acquire()) for _ in range(2)]
        await _settle()
        with pytest.raises(Overloaded, match="full.*2") as info:
            await adm.acquire()
        assert info.value.max_queued == 2
        assert (adm.num_inflight, adm.num_queued) == (1, 2)  # the refusal changed nothing
        for _ in range(3):
            adm.release()
            await _settle()
        await asyncio.gather(*waiters)
        assert adm.num_inflight == 0

    asyncio.run(main())


def test_zero_queue_rejects_immediately_when_busy():
    async def main() -> None:
        adm = Admission(1, 0)
        await adm.acquire()
        with pytest.raises(Overloaded):
            await adm.acquire()
        adm.release()
        await asyncio.wait_for(adm.acquire(), 1)

    asyncio.run(main())


def test_cancel_while_queued_leaves_queue_without_leak():
    async def main() -> None:
        adm = Admission(1, 3)
        await adm.acquire()
        a = asyncio.create_task(adm.acquire())
        b = asyncio.create_task(adm.acquire())
        c = asyncio.create_task(adm.acquire())
        await _settle()
        b.cancel()
        await _settle()
        assert b.cancelled() and adm.num_queued == 2
        # the freed queue place can be taken again
        d = asyncio.create_task(adm.acquire())
        await _settle()
        assert adm.num_queued == 3
        for waiter in (a, c, d):  # b is skipped; each release wakes the next live waiter
            adm.release()
            await asyncio.wait_for(waiter, 1)
            assert adm.num_inflight == 1
        adm.release()
        assert (adm.num_inflight, adm.num_queued) == (0, 0)
        await asyncio.wait_for(adm.acquire(), 0.1)  # admitted at once
        assert adm.num_inflight == 1

    asyncio.run(main())


def test_cancel_after_release_before_cancelled_queued_waiter_unwinds():
    async def main() -> None:
        # cancel marks the waiter done at once but it leaves the deque only when its task
        # runs; a release in between must skip it and wake the live one behind it.
        adm = Admission(1, 2)
        await adm.acquire()
        a = asyncio.create_task(adm.acquire())
        b = asyncio.create_task(adm.acquire())
        await _settle()
        a.cancel()
        adm.release()  # same tick: a has not unwound yet
        await asyncio.wait_for(b, 1)
        assert a.cancelled()
        assert (adm.num_inflight, adm.num_queued) == (1, 0)
        adm.release()
        assert adm.num_inflight == 0

    asyncio.run(main())


def test_slot_handed_to_waiter_cancelled_at_same_moment_is_passed_on():
    async def main() -> None:
        adm = Admission(1, 2)
        await adm.acquire()
        a = asyncio.create_task(adm.acquire())
        b = asyncio.create_task(adm.acquire())
        await _settle()
        adm.release()  # hands the slot to a ...
        a.cancel()  # ... which is cancelled before it could run
        await _settle()
        assert a.cancelled()
        await asyncio.wait_for(b, 1)  # a passed its slot on to b
        assert (adm.num_inflight, adm.num_queued) == (1, 0)
        adm.release()
        assert adm.num_inflight == 0
        await asyncio.wait_for(adm.acquire(), 0.1)

    asyncio.run(main())


def test_slot_handed_to_last_waiter_cancelled_is_freed():
    async def main() -> None:
        adm = Admission(1, 1)
        await adm.acquire()
        a = asyncio.create_task(adm.acquire())
        await _settle()
        adm.release()
        a.cancel()
        await _settle()
        assert a.cancelled()
        assert (adm.num_inflight, adm.num_queued) == (0, 0)
        await asyncio.wait_for(adm.acquire(), 0.1)

    asyncio.run(main())


def test_slot_context_manager_releases_on_error_and_cancel():
    async def main() -> None:
        adm = Admission(1, 1)
        with pytest.raises(RuntimeError, match="boom"):
            async with adm.slot():
                assert adm.num_inflight == 1
                raise RuntimeError("boom")
        assert adm.num_inflight == 0

        started = asyncio.Event()

        async def holder() -> None:
            async with adm.slot():
                started.set()
                await asyncio.sleep(10)

        task = asyncio.create_task(holder())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert adm.num_inflight == 0

    asyncio.run(main())


def test_release_without_slot_is_an_error():
    adm = Admission(1, 1)
    with pytest.raises(RuntimeError, match="no slot"):
        adm.release()


def test_many_concurrent_users_never_exceed_limit():
    async def main() -> None:
        adm = Admission(3, 100)
        peak = 0
        active = 0

        async def user(i: int) -> None:
            nonlocal peak, active
            async with adm.slot():
                active += 1
                peak = max(peak, active)
                await asyncio.sleep(0.001 * (i % 3))
                active -= 1

        tasks = [asyncio.create_task(user(i)) for i in range(40)]
        await asyncio.sleep(0)
        for t in tasks[5:40:4]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert peak == 3
        assert (adm.num_inflight, adm.num_queued) == (0, 0)

    asyncio.run(main())


def test_closed_turns_newcomers_away_and_keeps_the_line():
    async def main() -> None:
        adm = Admission(1, 2)
        await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await _settle()
        adm.close()
        with pytest.raises(ShuttingDown):
            await adm.acquire()
        assert (adm.num_inflight, adm.num_queued) == (1, 1)  # the refusal took nothing
        adm.release()
        await asyncio.wait_for(waiter, 1)  # queued before the close: still served
        adm.release()
        assert adm.num_inflight == 0

    asyncio.run(main())
