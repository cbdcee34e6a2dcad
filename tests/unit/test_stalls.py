"""The claim's idle timeout in auto mode (stalls.py): what it learns from a relay's stalls."""

from __future__ import annotations

import time

import anyio
import pytest

from notify_outbox.relay.stalls import (
    AUTO_CEILING,
    AUTO_FLOOR,
    FACTOR,
    REST_AFTER,
    SAMPLES,
    TICK,
    WARMUP,
    ClaimIdleTimeout,
)
from tests.faults.harness import eventually

pytestmark = pytest.mark.anyio


def _fed(*loop: tuple[int, float], round_trips: tuple[tuple[int, float], ...] = ()) -> float:
    """The auto timeout after the loop watch saw ``count`` stalls of ``seconds`` for each
    ``(count, seconds)`` in turn (and the BEGIN round trips likewise)."""
    timeout = ClaimIdleTimeout(None)
    for count, seconds in loop:
        for _ in range(count):
            timeout.loop.add(seconds)
    for count, seconds in round_trips:
        for _ in range(count):
            timeout.round_trip(seconds)
    return timeout.current()


def test_a_fixed_timeout_is_used_as_it_is() -> None:
    timeout = ClaimIdleTimeout(0.5)
    for _ in range(SAMPLES):
        timeout.loop.add(3.0)
    assert not timeout.auto
    assert timeout.current() == 0.5


def test_a_starting_relay_keeps_the_ceiling_until_it_has_watched_its_loop() -> None:
    assert _fed() == AUTO_CEILING
    assert _fed((WARMUP - 1, 0.001)) == AUTO_CEILING
    assert _fed((WARMUP, 0.001)) == AUTO_FLOOR


def test_a_quiet_loop_gets_the_floor() -> None:
    assert _fed((SAMPLES, 0.002)) == AUTO_FLOOR
    # Three times the worst stall and round trip is still under the floor.
    assert _fed((SAMPLES - 1, 0.002), (1, 0.03), round_trips=((100, 0.001),)) == AUTO_FLOOR


def test_the_worst_recent_stall_sets_it_at_once() -> None:
    # One GC pause of 120 ms among quiet looks: three times that, from the next claim on.
    assert _fed((SAMPLES - 1, 0.002), (1, 0.12)) == pytest.approx(0.36)
    assert _fed((1000, 0.002), (1, 0.12), (10, 0.002)) == pytest.approx(0.36)
    # Worse than the ceiling allows (but not a freeze): the ceiling.
    assert _fed((SAMPLES - 1, 0.002), (1, 1.5)) == AUTO_CEILING


def test_freezes_longer_than_the_ceiling_do_not_count() -> None:
    # Six SIGSTOPs of 6 s: the claim is lost to each whatever the timeout, and a relay
    # frozen again must again free its keys quickly.
    assert _fed((SAMPLES - 6, 0.002), (6, 6.0)) == AUTO_FLOOR


def test_only_recent_looks_count() -> None:
    # A stormy start, then a quiet stretch as long as the window: the storm is forgotten.
    assert _fed((SAMPLES, 0.3), (SAMPLES, 0.002)) == AUTO_FLOOR
    # Not before: one stormy look left in the window still counts.
    assert _fed((SAMPLES, 0.3), (SAMPLES - 1, 0.002)) == pytest.approx(0.9)


def test_slow_round_trips_to_postgresql_add_to_it() -> None:
    # A distant database (a BEGIN takes up to 80 ms): every statement of a claim, and every
    # renewal, comes that much later.
    assert _fed((SAMPLES, 0.01), round_trips=((200, 0.08),)) == pytest.approx(0.27)


async def test_the_watch_sees_the_event_loop_blocked() -> None:
    timeout = ClaimIdleTimeout(None)
    # A fixed timeout needs no watch: it returns at once.
    await ClaimIdleTimeout(1.0).watch_loop()
    async with anyio.create_task_group() as tg:
        tg.start_soon(timeout.watch_loop)
        timeout.for_claim()  # the watch rests until claims come

        async def looked(times: int) -> bool:
            return len(timeout.loop) >= times

        await eventually(lambda: looked(WARMUP), within=10, interval=0.005, what="warmed up")
        seen = len(timeout.loop)
        # The stimulus: the loop blocked, as by a long GC pause or a CPU limit.
        time.sleep(0.4)  # noqa: ASYNC251
        await eventually(lambda: looked(seen + 1), within=5, interval=0.005, what="a look")
        tg.cancel_scope.cancel()
    # 0.4 s, less at most the tick the watch was asleep for anyway.
    assert timeout.current() >= FACTOR * (0.4 - TICK)


async def test_the_watch_rests_while_no_claim_comes() -> None:
    clock = [0.0]
    timeout = ClaimIdleTimeout(None, clock=lambda: clock[0])
    clock[0] = REST_AFTER + 1  # no claim yet
    async with anyio.create_task_group() as tg:
        tg.start_soon(timeout.watch_loop)
        await anyio.wait_all_tasks_blocked()
        assert len(timeout.loop) == 0, "an idle relay's watch looked"
        assert timeout.for_claim() == AUTO_CEILING  # and wakes it

        async def looked() -> bool:
            return len(timeout.loop) >= 2

        await eventually(looked, within=5, interval=0.01, what="the watch looked")
        tg.cancel_scope.cancel()
