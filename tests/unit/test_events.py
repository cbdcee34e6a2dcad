"""RelayEvents: what tests wait on instead of sleeping."""

from __future__ import annotations

import anyio
import pytest

from notify_outbox.core.events import RelayEvents

pytestmark = pytest.mark.anyio


async def test_wait_after_returns_for_an_event_already_emitted_and_waits_for_the_next() -> None:
    events = RelayEvents()
    seen = events.seen
    events.emit("claimed", 5)  # after the read: not missed
    with anyio.fail_after(1):
        await events.wait_after(seen)
    seen = events.seen
    woke = anyio.Event()

    async def waiter() -> None:
        await events.wait_after(seen)
        woke.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert not woke.is_set()  # nothing new yet
        events.emit("idle")
        with anyio.fail_after(1):
            await woke.wait()
    assert events.seen == 2
