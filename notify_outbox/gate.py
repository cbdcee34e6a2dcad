"""The gated notify, relay side: when producers may skip their NOTIFY, and how the relay lets
them notify again without missing a row.

Migration 0002 holds the producers' side and the protocol's proof. In short, with two advisory
keys per outbox:

- A (awake) is held, at session level, on the relay's listening connection while the relay is
  busy draining: producers then skip their NOTIFY (a NOTIFY takes a cluster-wide lock at
  commit), since an awake relay looks for rows anyway;
- G (gate) is held shared by every inserting statement until its transaction ends;
- the relay releases A only in a statement that got G exclusively (no producer in flight),
  then looks once more: every producer that skipped its NOTIFY has committed by then.

A is a session-level lock, so it is only taken on a connection that is PostgreSQL's own
session (not one lent by a pooler, which could outlive the relay). The statements run on the
listener's connection (``Listener.session_statement``); everything else lives here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import anyio
import asyncpg

from .backoff import Backoff
from .events import RelayEvents
from .listener import Listener
from .settings import OutboxSettings
from .sqlfiles import Queries

__all__ = ["Gate"]

log = logging.getLogger("notify_outbox.gate")

# When try_sleep keeps failing (a producer's transaction stays open), the last busy worker
# retries it this many times, with doubling waits from gate_poll_interval, then lets producers
# notify again and watches G with a backoff up to _WATCH_CAP seconds.
_SLEEP_TRIES = 6
_WATCH_CAP = 2.0


class Gate:
    """The relay's part of the gated notify: mark awake, try to sleep, look once more.

    ``look()`` says whether a claim would find something; ``wake(source)`` rings a worker;
    ``stopping()`` whether the relay is stopping. ``enabled`` is set by the relay once it
    knows the outbox's notify mode (a relay in poll-only mode never marks itself awake).
    """

    def __init__(
        self,
        settings: OutboxSettings,
        events: RelayEvents,
        *,
        look: Callable[[], Awaitable[bool]],
        wake: Callable[[str], None],
        stopping: Callable[[], bool],
    ) -> None:
        self._settings = settings
        self._events = events
        #: The listening connection's owner (set once the relay starts listening).
        self.listener: Listener | None = None
        self._queries = Queries(settings.names)
        self._look = look
        self._wake = wake
        self._stopping = stopping
        self.enabled = False
        # The connection on which A was taken: A is held while that session lives.
        self._marked_on: asyncpg.Connection | None = None
        self._sleep_tries = 0  # try_sleep refused in a row (producers in flight)
        self._lock = asyncio.Lock()  # A's state changes one at a time
        self._watch: asyncio.Task[None] | None = None

    @property
    def awake(self) -> bool:
        """Whether this relay holds A (producers skip their NOTIFY)."""
        marked_on = self._marked_on
        if marked_on is None or self.listener is None:
            return False
        return not marked_on.is_closed() and self.listener.connection is marked_on

    async def _statement(self, name: str) -> bool | None:
        """One gate statement on the listening connection; None without a healthy one."""
        if self.listener is None:
            return None
        result = await self.listener.session_statement(self._queries[name])
        return None if result is None else result[1]

    async def busy_for(self, seconds: float) -> None:
        """A worker has been claiming without a break for ``seconds``: after
        ``gate_awake_after`` of it, take A, so producers stop notifying."""
        if not self.enabled or seconds < self._settings.gate_awake_after:
            return
        listener = self.listener
        if listener is None or not listener.direct:
            return  # through a pooler A could outlive this relay: producers keep notifying
        # The check and the statement under one lock: advisory locks are re-entrant, and A
        # taken twice would stay held after the sleep protocol's one release.
        async with self._lock:
            if self.awake:
                return
            result = await listener.session_statement(self._queries["mark_awake"])
            if result is None or not result[1]:
                return
            self._marked_on = result[0]
        self._events.emit("gate_awake")

    def _asleep(self) -> None:
        """A is released (or its session is gone, which released it)."""
        if self._marked_on is not None:
            self._marked_on = None
            self._events.emit("gate_sleep")

    def _must_sleep(self, busy_workers: int) -> bool:
        """Only the last busy worker of an awake relay runs the sleep protocol."""
        return self.awake and busy_workers == 1 and not self._stopping()

    async def settle(self, busy_workers: int) -> bool:
        """Called by a worker that found nothing more to claim. True: claim again (rows are
        due, or the protocol needs another round). False: this worker may idle."""
        s = self._settings
        if not self._must_sleep(busy_workers):
            return False
        if await self._linger():
            return True
        async with self._lock:
            released = await self._statement("try_sleep") if self.awake else True
            if released is not False:
                self._asleep()
        if released is False:
            self._events.emit("gate_busy")
            # Producers in flight may have skipped their NOTIFY: stay awake a little, with
            # doubling waits; a producer transaction that stays open must not make an idle
            # relay spin.
            if self._sleep_tries < _SLEEP_TRIES:
                await anyio.sleep(s.gate_poll_interval * 2**self._sleep_tries)
                self._sleep_tries += 1
                return True
            # Let producers notify again now, and look once more when every producer that
            # may have skipped its NOTIFY has finished.
            async with self._lock:
                if self.awake:
                    await self._statement("release_awake")
                self._asleep()
            self._start_watch()
        # Producers notify again.
        self._sleep_tries = 0
        # One more look, as a new statement, sees every row whose producer skipped its
        # NOTIFY (they have all committed).
        if await self._look():
            return True
        # A sibling woken meanwhile may have marked the relay awake again and gone idle while
        # this worker was still busy: then this worker, the last one busy, must put it to
        # sleep, or producers would skip their NOTIFY with nobody claiming.
        return self._must_sleep(busy_workers)

    async def _linger(self) -> bool:
        """Look every ``gate_poll_interval`` for ``gate_linger`` seconds; True as soon as rows
        are due. A look is one cheap statement, not a claim transaction."""
        s = self._settings
        deadline = anyio.current_time() + s.gate_linger
        while anyio.current_time() < deadline and not self._stopping():
            await anyio.sleep(s.gate_poll_interval)
            if await self._look():
                return True
        return False

    def _start_watch(self) -> None:
        """Wake a worker once no producer is in flight any more (in the background, so the
        workers stay free to answer notifications meanwhile)."""
        if self._watch is not None and not self._watch.done():
            return

        async def watch() -> None:
            backoff = Backoff(self._settings.gate_poll_interval, _WATCH_CAP)
            while not self._stopping():
                await backoff.sleep()
                if await self._statement("gate_free") is not False:
                    self._wake("gate")
                    return
                self._events.emit("gate_busy")

        self._watch = asyncio.create_task(watch(), name="notify-outbox-gate-watch")

    def close(self) -> None:
        """Stop watching G (the relay is stopping)."""
        if self._watch is not None:
            self._watch.cancel()
