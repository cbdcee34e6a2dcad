"""The gated notify, relay side: when producers may skip their NOTIFY, and how the relay lets
them notify again without missing a row.

Migrations 0002 and 0006 hold the producers' side and the protocol's proof. In short:

- the awake marker: while the relay is busy draining, and only while it makes progress, it
  holds the advisory locks of the current and the next epoch of ``awake_epoch_ms`` (renewed
  once per epoch, mid-epoch), on its listening connection; producers probe the current
  epoch's lock and skip their NOTIFY (a NOTIFY takes a cluster-wide lock at commit) when it
  is held, since an awake relay looks for rows anyway. A relay that stops claiming (frozen,
  cut off from Kafka) stops renewing, and within two epochs producers notify again, waking
  the other relays;
- G (gate) is held shared by every inserting statement until its transaction ends;
- the relay lets go of its epochs only in a statement that got G exclusively (no producer in
  flight), then looks once more: every producer that skipped its NOTIFY has committed by then.

The marker is a session-level lock, so it is only taken on a connection that is PostgreSQL's
own session (not one lent by a pooler, which could outlive the relay). The statements run on
the listener's connection (``Listener.session_statement``); everything else lives here.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

import anyio
import asyncpg

from notify_outbox.core.backoff import Backoff
from notify_outbox.core.events import RelayEvents
from notify_outbox.core.settings import OutboxSettings
from notify_outbox.pg.sqlfiles import Queries

from .listener import Listener

__all__ = ["Gate"]

log = logging.getLogger("notify_outbox.gate")

# When try_sleep keeps failing (a producer's transaction stays open), the last busy worker
# retries it this many times, with doubling waits from gate_poll_interval, then lets producers
# notify again and watches G with a backoff up to _WATCH_CAP seconds.
_SLEEP_TRIES = 6
_WATCH_CAP = 2.0
# The marker is renewed while a claim started or ended within this many epochs.
_PROGRESS_EPOCHS = 4
# Time constant of the claimed-rows rate (s): the rate forgets a burst within a few of them.
_RATE_TAU = 0.1


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
        #: Length of an epoch of the awake marker, from the outbox's config (migration 0006).
        self.epoch_ms = 25
        # The connection on which the marker was taken: the relay is awake (producers may have
        # skipped their NOTIFY on its account) until the sleep protocol ran or that session is
        # gone. The epochs whose locks it holds there now (none once they lapsed unrenewed).
        self._marked_on: asyncpg.Connection | None = None
        self._held: list[int] = []
        self._renewed_in = -1  # the epoch (this host's clock) of the last renewal (or try)
        self._progress_at = -1e9  # monotonic time a claim last started or ended
        self._sleep_tries = 0  # try_sleep refused in a row (producers in flight)
        # Rows claimed per second, decaying with _RATE_TAU, as of _rate_at (monotonic).
        self._rate = 0.0
        self._rate_at = time.monotonic()
        self._lock = asyncio.Lock()  # the marker's state changes one at a time
        self._watch: asyncio.Task[None] | None = None
        # Set when the marker is taken: the renewer rests until then (a relay serving many
        # outboxes has a gate per outbox, and most of them are never awake).
        self._marked = asyncio.Event()

    @property
    def awake(self) -> bool:
        """Whether this relay marked itself awake (producers may skip their NOTIFY) and has
        not run the sleep protocol since."""
        marked_on = self._marked_on
        if marked_on is None or self.listener is None:
            return False
        return not marked_on.is_closed() and self.listener.connection is marked_on

    async def _statement(self, name: str, *args: object) -> bool | None:
        """One gate statement on the listening connection; None without a healthy one."""
        if self.listener is None:
            return None
        result = await self.listener.session_statement(self._queries[name], *args)
        return None if result is None else bool(result[1])

    def rate(self) -> float:
        """Rows this relay claimed per second lately (an exponentially decaying average)."""
        return self._rate * math.exp((self._rate_at - time.monotonic()) / _RATE_TAU)

    def _paying(self, share: float = 1.0) -> bool:
        """Whether the relay claims at least ``share`` of ``gate_awake_rate`` rows per second:
        only then does sparing producers their NOTIFY pay for the looks of an awake relay
        (below it, producers notify and each row costs one claim, woken at once)."""
        return self.rate() >= share * self._settings.gate_awake_rate

    async def busy_for(self, seconds: float, rows: int) -> None:
        """A worker has been claiming without a break for ``seconds`` and just claimed
        ``rows``: after ``gate_awake_after`` of it, at ``gate_awake_rate`` rows per second or
        more, hold the awake marker, and renew it once per epoch (a relay that stops making
        progress lets it lapse, and producers notify again)."""
        now = time.monotonic()
        self._rate = self._rate * math.exp((self._rate_at - now) / _RATE_TAU) + rows / _RATE_TAU
        self._rate_at = now
        if not self.enabled or self._renewed_lately():
            return
        if not self.awake and (seconds < self._settings.gate_awake_after or not self._paying()):
            return
        await self._hold(mark=True)

    def progress(self) -> None:
        """A worker started or ended a claim: the relay is claiming now."""
        self._progress_at = time.monotonic()

    async def renew_while_claiming(self) -> None:
        """Renew the marker once per epoch while claims start or end, not only when one
        ends with rows: under load a claim's round (Kafka's acks included) can outlast the
        marker's two epochs, and each lapse lets producers NOTIFY, whose commits PostgreSQL
        serializes. A frozen process renews nothing (this task is frozen too), and a relay
        whose claims stop moving stops renewing after ``_PROGRESS_EPOCHS`` epochs.

        It wakes in the middle of each epoch by this host's clock: taking the current and
        the next epoch there keeps the current one held without a gap while the database's
        clock is within half an epoch of this one (a larger skew or a late wake-up leaves
        a gap, in which producers simply notify). Once per epoch is half the statements of
        renewing every half epoch, a fixed cost per second that shows at steady load."""
        while True:
            if not self.awake:
                self._marked.clear()
                await self._marked.wait()
            epoch_s = self.epoch_ms / 1000
            into = (time.time() / epoch_s) % 1.0  # how far into its epoch the clock is
            await anyio.sleep(epoch_s * ((0.5 - into) if into < 0.5 else (1.5 - into)))
            recent = time.monotonic() - self._progress_at < epoch_s * _PROGRESS_EPOCHS
            if self.awake and recent and not self._renewed_lately():
                await self._hold(mark=False)

    async def _hold(self, *, mark: bool) -> None:
        """Take the current and the next epoch (``mark``: also when not awake yet)."""
        listener = self.listener
        if listener is None or not listener.direct:
            return  # through a pooler the marker could outlive this relay: producers notify
        # The check and the statement under one lock: advisory locks are re-entrant, and an
        # epoch taken twice would stay held after the sleep protocol's one release.
        async with self._lock:
            if self._renewed_lately():
                return  # a sibling worker did it meanwhile
            if not mark and not self.awake:
                # The sleep protocol ran meanwhile: only a worker's busy run may mark the
                # relay awake again (producers that skip their NOTIFY need a relay claiming).
                return
            if self._marked_on is not None and not self.awake:
                self._asleep()  # that session is gone, and its locks with it
            held = self._held if self.awake else []
            result = await listener.session_statement(
                self._queries["hold_awake"], held, self.epoch_ms
            )
            self._renewed_in = self._epoch_now()
            if result is None:
                self._asleep()
                return
            conn, now_held = result
            self._events.emit("gate_renewed")
            if held and now_held and min(now_held) > max(held):
                # Renewed late (a late wake-up, a slow statement): the epochs held had ended,
                # and producers notified meanwhile, as they should.
                self._events.emit("gate_lapse")
            self._held = list(now_held)
            if self._marked_on is None and self._held:
                self._marked_on = conn
                self._marked.set()
                self._events.emit("gate_awake")

    def _renewed_lately(self) -> bool:
        """Whether the marker was renewed (or tried: other relays may hold the epochs) in
        the current epoch by this host's clock (it holds that epoch and the next)."""
        return self._epoch_now() == self._renewed_in

    def _epoch_now(self) -> int:
        return int(time.time() * 1000) // self.epoch_ms

    async def release(self) -> None:
        """Let producers notify again at once (Kafka is away: this relay claims nothing, and
        the others must be woken), and look once more when no producer that may have
        skipped its NOTIFY is in flight."""
        async with self._lock:
            if not self.awake:
                return
            await self._statement("release_awake", self._held)
            self._asleep()
        self._start_watch()

    def _asleep(self) -> None:
        """The marker is let go (or its session is gone, which let it go)."""
        self._held = []
        self._renewed_in = -1  # the next busy run may take it at once
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
        # Linger only while rows come fast enough to pay for the looks (hysteresis: half the
        # rate that marks the relay awake); slower, producers may as well notify again now.
        if self._paying(0.5) and await self._linger():
            return True
        async with self._lock:
            released = await self._statement("try_sleep", self._held) if self.awake else True
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
            await self.release()
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
