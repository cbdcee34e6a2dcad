"""Renewing a claim's transaction while its rows are published, without a task per claim.

A claim's transaction is ended by the server after ``idle_timeout`` of silence (stalls.py),
so while Kafka takes long to acknowledge, the claim says something (``SELECT 1``) every
quarter of it. Almost every publish ends long before the first renewal is due; running the
publish in a task of its own, beside a loop that renews, cost every claim a trip through the
event loop before its first record was handed over (55 µs of a quiet relay's ~250 µs from
the rows to the hand-over). So the publish runs in the claiming task, and a renewing task is
started only when the first renewal comes due.

A renewal that fails (the session is gone) ends the publish as the old loop did: the
claiming task is cancelled, and ``publish`` raises the renewal's error instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class _Renewals:
    def __init__(self, renew: Callable[[], Awaitable[object]], every: float) -> None:
        self._renew = renew
        self._every = every
        self._owner = asyncio.current_task()
        self._task: asyncio.Task[None] | None = None
        self._done = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            every, self._start
        )
        #: The renewal's error, once one failed.
        self.failure: BaseException | None = None
        self._cancelled_owner = False

    def _start(self) -> None:
        self._timer = None
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            while not self._done.is_set():
                await self._renew()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._done.wait(), self._every)
        except Exception as e:  # a session gone, a statement refused: the claim is over
            self.failure = e
            if not self._done.is_set() and self._owner is not None:
                self._cancelled_owner = True
                self._owner.cancel()

    def owner_cancelled_by_us(self) -> bool:
        return self._cancelled_owner

    async def stop(self) -> None:
        """No more renewals; waits for one under way (the claim's connection is then free
        for the caller's next statement)."""
        self._done.set()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            # Never cancelled mid-statement: that would leave the connection mid-protocol.
            await asyncio.shield(self._task)


async def publish_renewing(
    publish: Callable[[], Awaitable[T]], renew: Callable[[], Awaitable[object]], every: float
) -> T:
    """``await publish()``, calling ``renew()`` every ``every`` seconds while it runs (the
    first after ``every``). If a renewal fails, the publish is cancelled (if still running)
    and the renewal's error raised."""
    renewals = _Renewals(renew, every)
    try:
        result = await publish()
    except asyncio.CancelledError:
        if not renewals.owner_cancelled_by_us():
            raise
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        assert renewals.failure is not None
        raise renewals.failure from None
    finally:
        await renewals.stop()
    if renewals.failure is not None:  # failed while the publish ended
        raise renewals.failure
    return result
