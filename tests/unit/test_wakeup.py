"""The retry timers (``wakeup.RetryTimers``): a timer whose rows were all claimed early is
cancelled, so it never wakes a worker into an empty claim; other timers fire. And the
doorbell's remembered ring."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from notify_outbox.relay.wakeup import Doorbell, RetryTimers

pytestmark = pytest.mark.anyio


class Fired:
    def __init__(self) -> None:
        self.count = 0
        self.event = asyncio.Event()

    def __call__(self) -> None:
        self.count += 1
        self.event.set()

    async def next(self) -> None:
        with anyio.fail_after(5):
            await self.event.wait()
        self.event.clear()


async def test_a_timer_whose_rows_were_all_claimed_is_cancelled() -> None:
    fired = Fired()
    timers = RetryTimers(fired)
    timers.after(0.0, [1, 2])
    timers.after(10.0, [3])
    assert timers.tracking
    assert len(timers) == 2
    timers.claimed([1])
    assert len(timers) == 2  # row 2 still waits for the first timer
    timers.claimed([2, 3, 99])  # 99: a row no timer was for
    assert len(timers) == 0
    assert not timers.tracking
    # A timer for rows it does not know fires whatever is claimed, also one that was for
    # rows first (and then it tracks them no more).
    timers.after(0.0, [4])
    timers.after(0.0)
    assert not timers.tracking
    timers.claimed([1, 2, 3, 4])
    await fired.next()
    assert fired.count == 1
    assert len(timers) == 0


async def test_rows_due_at_one_deadline_share_a_timer_and_it_fires() -> None:
    fired = Fired()
    timers = RetryTimers(fired)
    timers.after(0.0, [1])
    timers.after(0.0, [2])
    assert len(timers) == 1
    timers.claimed([1])
    await fired.next()
    assert fired.count == 1
    assert not timers.tracking


async def test_a_rescheduled_row_leaves_its_earlier_timer() -> None:
    fired = Fired()
    timers = RetryTimers(fired)
    timers.after(10.0, [1])
    timers.after(20.0, [1])
    assert len(timers) == 1  # the first timer had no other row: cancelled
    assert timers.near(20.0)
    assert not timers.near(10.0)
    timers.cancel()
    assert len(timers) == 0
    assert not timers.tracking


async def test_a_remembered_ring_wakes_nobody_and_lets_the_next_waiter_through() -> None:
    bell = Doorbell()
    idle = asyncio.ensure_future(bell.wait())
    await asyncio.sleep(0)
    bell.remember()
    await asyncio.sleep(0)
    assert not idle.done(), "remember() must not wake an idle worker"
    with anyio.fail_after(1):
        assert await bell.wait()  # the busy worker's next wait goes on at once
    bell.ring()
    with anyio.fail_after(1):
        assert await idle
