"""publish_renewing: a claim's renewals while its rows are published (relay/keepalive.py)."""

from __future__ import annotations

import asyncio

import pytest

from notify_outbox.relay.keepalive import publish_renewing

pytestmark = pytest.mark.anyio


class SessionGone(Exception):
    pass


async def test_a_quick_publish_runs_in_the_callers_task_and_renews_nothing() -> None:
    renewals: list[float] = []
    caller = asyncio.current_task()
    ran_in: list[asyncio.Task[object] | None] = []

    async def publish() -> str:
        ran_in.append(asyncio.current_task())
        return "acked"

    async def renew() -> None:
        renewals.append(1)

    assert await publish_renewing(publish, renew, 0.05) == "acked"
    await asyncio.sleep(0.1)  # past the first renewal's time: its timer was cancelled
    assert ran_in == [caller]
    assert renewals == []


async def test_a_slow_publish_is_renewed_every_period_until_it_ends() -> None:
    acked = asyncio.Event()
    renewals = 0

    async def renew() -> None:
        nonlocal renewals
        renewals += 1
        if renewals == 3:
            acked.set()

    async def publish() -> str:
        await acked.wait()
        return "acked"

    assert await publish_renewing(publish, renew, 0.01) == "acked"
    assert renewals == 3
    await asyncio.sleep(0.05)
    assert renewals == 3  # none after the publish ended


async def test_a_failed_renewal_ends_the_publish_with_the_renewals_error() -> None:
    cancelled = asyncio.Event()

    async def renew() -> None:
        raise SessionGone("the server ended the claim")

    async def publish() -> str:
        try:
            await asyncio.Event().wait()  # acks that never come
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    with pytest.raises(SessionGone, match="ended the claim"):
        async with asyncio.timeout(5):  # a publish never ended would hang here
            await publish_renewing(publish, renew, 0.01)
    assert cancelled.is_set()
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0  # the caller is not left cancelled
    await asyncio.sleep(0)  # and no cancellation is still on its way to it


async def test_a_renewal_under_way_when_the_publish_ends_is_waited_for() -> None:
    # The claim's connection must be free when the caller goes on to mark the rows.
    in_renewal = asyncio.Event()
    release = asyncio.Event()
    finished: list[str] = []

    async def renew() -> None:
        in_renewal.set()
        await release.wait()
        finished.append("renewal")

    async def publish() -> str:
        await in_renewal.wait()
        asyncio.get_running_loop().call_later(0.02, release.set)
        return "acked"

    assert await publish_renewing(publish, renew, 0.01) == "acked"
    assert finished == ["renewal"]


async def test_a_renewal_failing_as_the_publish_ends_is_raised() -> None:
    in_renewal = asyncio.Event()
    release = asyncio.Event()

    async def renew() -> None:
        in_renewal.set()
        await release.wait()
        raise SessionGone("gone")

    async def publish() -> str:
        await in_renewal.wait()
        asyncio.get_running_loop().call_later(0.01, release.set)
        return "acked"

    with pytest.raises(SessionGone):
        await publish_renewing(publish, renew, 0.01)


async def test_the_callers_cancellation_goes_through_and_stops_the_renewals() -> None:
    renewals = 0
    started = asyncio.Event()

    async def renew() -> None:
        nonlocal renewals
        renewals += 1
        started.set()

    async def publish() -> str:
        await asyncio.Event().wait()
        return "never"

    task = asyncio.ensure_future(publish_renewing(publish, renew, 0.01))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    seen = renewals
    await asyncio.sleep(0.05)
    assert renewals == seen
