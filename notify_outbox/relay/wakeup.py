"""How workers are woken: a doorbell rung by the listener, the poller and busy workers,
and timers for retries coming due.

A ring wakes one idle worker; when none is idle, the ring is remembered (once), so a worker
finishing a batch claims again instead of sleeping. Many notifications during a drain
therefore fold into a single extra claim.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable

__all__ = ["Doorbell", "RetryTimers"]


class Doorbell:
    """Wakes idle workers; ``close`` releases every waiter for shutdown."""

    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[bool]] = deque()
        self._pending = False
        self._closed = False

    def ring(self) -> None:
        """Wake one idle worker, or remember the ring if all are busy."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                return
        self._pending = True

    def remember(self) -> None:
        """Wake nobody now: the next worker to wait goes and claims at once (for a wake-up
        that a busy worker will serve, in case its last claim had just missed it)."""
        self._pending = True

    def ring_all(self) -> None:
        """Wake every idle worker (after a reconnect or at start: a backlog may be waiting)."""
        woke = False
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                woke = True
        if not woke:
            self._pending = True

    def close(self) -> None:
        """Release every waiter with False: the relay is stopping."""
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(False)

    async def wait(self) -> bool:
        """Wait for a ring; True to go and claim, False when closed."""
        if self._closed:
            return False
        if self._pending:
            self._pending = False
            return True
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        finally:
            if not waiter.done():
                waiter.cancel()


#: Timer deadlines are rounded up to this grid (seconds), so that a burst of failures shares
#: one timer; a little late never hurts, early would find the row not yet due.
_GRID = 0.05


class RetryTimers:
    """One timer per retry deadline, each remembering the rows it is for.

    A claim woken by one timer takes every row due by then, often the rows of later timers
    too (their deadlines differ by the retry jitter). Those timers would then wake a worker
    into an empty claim, a transaction for nothing while a failing key waits: so a timer
    whose rows were all claimed meanwhile is cancelled (``claimed``). A timer with no rows
    (a wake-up after a busy claim, or for a retry some other relay scheduled) always fires.
    """

    def __init__(self, fire: Callable[[], None]) -> None:
        self._fire = fire
        self._handles: dict[float, asyncio.TimerHandle] = {}
        #: Per deadline, the rows it is for; None: fires whatever was claimed.
        self._rows: dict[float, set[int] | None] = {}
        self._deadline_of: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self._handles)

    @property
    def tracking(self) -> bool:
        """Whether any timer is waiting for rows (cheap, checked per claim)."""
        return bool(self._deadline_of)

    def after(self, delay: float, rows: Iterable[int] | None = None) -> None:
        """Wake a worker ``delay`` seconds from now (plus a 10 ms margin for the database's
        clock, rounded up to the grid); ``rows``: the row ids that come due then."""
        loop = asyncio.get_running_loop()
        at = -(-(loop.time() + delay + 0.01) // _GRID) * _GRID
        if at not in self._handles:
            self._handles[at] = loop.call_at(at, self._expire, at)
            self._rows[at] = set() if rows is not None else None
        wanted = self._rows[at]
        if rows is None:
            # Now also a wake-up for rows it does not know: it fires whatever is claimed, so
            # it no longer answers for the rows it was for.
            for row in wanted or ():
                self._deadline_of.pop(row, None)
            self._rows[at] = None
        elif wanted is not None:
            for row in rows:
                if self._deadline_of.get(row, at) != at:
                    self.claimed((row,))  # rescheduled: its earlier timer is not for it now
                wanted.add(row)
                self._deadline_of[row] = at

    def near(self, delay: float, slack: float = 2 * _GRID) -> bool:
        """Whether a timer fires within ``slack`` of ``delay`` seconds from now."""
        target = asyncio.get_running_loop().time() + delay
        return any(abs(at - target) <= slack for at in self._handles)

    def claimed(self, rows: Iterable[int]) -> None:
        """These rows were claimed: a timer left with none of its rows is cancelled."""
        for row in rows:
            at = self._deadline_of.pop(row, None)
            if at is None:
                continue
            wanted = self._rows.get(at)
            if wanted is None:
                continue
            wanted.discard(row)
            if not wanted:
                self._handles.pop(at).cancel()
                del self._rows[at]

    def cancel(self) -> None:
        """Cancel every timer (the relay stops)."""
        for handle in self._handles.values():
            handle.cancel()
        self._handles.clear()
        self._rows.clear()
        self._deadline_of.clear()

    def _expire(self, at: float) -> None:
        self._handles.pop(at, None)
        for row in self._rows.pop(at, None) or ():
            self._deadline_of.pop(row, None)
        self._fire()
