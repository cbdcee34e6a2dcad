"""How workers are woken: a doorbell rung by the listener, the poller and busy workers.

A ring wakes one idle worker; when none is idle, the ring is remembered (once), so a worker
finishing a batch claims again instead of sleeping. Many notifications during a drain
therefore fold into a single extra claim.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["Doorbell"]


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
