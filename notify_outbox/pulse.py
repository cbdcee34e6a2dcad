"""A relay's pulse, and the end of a frozen relay's claims.

A claim holds its keys in an open transaction. A relay frozen inside one (SIGSTOP, a VM pause,
a debugger) holds them until PostgreSQL ends the claim after ``claim_idle_timeout`` (2 s), and
its keys' later events wait that long. A shorter idle timeout cannot tell a frozen relay from
one whose event loop is only slow, and a claim ended under a slow relay after its records went
out is published twice (docs/concepts/claim.md).

The pulse tells them apart. Each relay runs a thread with its own event loop and its own
connection (``application_name`` ``notify-outbox-pulse/<relay id>``), which beats (one
statement every ``PULSE_EVERY``) while a claim of the relay has been open longer than
``BEAT_AFTER``, and (every ``REAP_EVERY``) for a while after a claim met buckets held by
other claims, if other relays with a pulse are connected. A busy or
starved event loop does not silence it (the thread needs the interpreter for microseconds,
which it gets within the switch interval, 5 ms); a stopped process does. The beat is the
reaper: it ends (``pg_terminate_backend``) the worker sessions of other relays that sat idle
in their transaction longer than ``frozen_relay_timeout`` while their relay's pulse session
was idle as long. Their rows and key buckets are free at once, and the reaping relay wakes
its workers. Claims of a few milliseconds (the common case) cost no statement, and an idle
relay's pulse thread sleeps until a claim wakes it. A live relay's first beat comes at most
two ``PULSE_EVERY`` (50 ms) after its claim began, and its claim is ended only after
``frozen_relay_timeout`` (0.15 s) without a beat: its thread has 100 ms of slack (measured on
this 2-core VM: a helper thread's 25 ms timer beside a busy event loop fired at most 50 ms
late, 31 ms with three CPU hogs beside it, 111 ms with sixteen).

What it does not do: end the claim of a relay that has no pulse (an older version, one behind
a connection pooler, where pids and sessions do not map, or one whose pulse is disabled); those
still wait for the idle timeout. Sessions are matched by ``application_name`` and database, so
both relays need the right to see and signal each other's backends (the same role, or
``pg_signal_backend``); without it the reaper says so once and only pulses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

import asyncpg

from .db import DATABASE_ERRORS, session_parameters

log = logging.getLogger("notify_outbox.pulse")

WORKER_APP = "notify-outbox-worker"
PULSE_APP = "notify-outbox-pulse"
#: Seconds between two beats while the pulse beats.
PULSE_EVERY = 0.025
#: The pulse beats while a claim of the relay has been open this long (claims of a few
#: milliseconds, the common case, cost no statement): the first beat comes at most two
#: PULSE_EVERY after the claim began, well inside frozen_relay_timeout.
BEAT_AFTER = PULSE_EVERY
#: It also beats, and ends frozen claims, every REAP_EVERY for this many
#: frozen_relay_timeouts (at least REAP_AT_LEAST seconds) after a claim met buckets held by
#: other claims (a frozen relay's, maybe, which falls due within one timeout) while other
#: relays with a pulse are connected (looked up at most every PEERS_EVERY: a relay alone
#: meets its own workers' buckets all the time, and has no one to end). A beat costs about
#: 0.6 ms of CPU on a 2-core VM, most of it the thread's wake-up.
REAP_EVERY = 0.05
REAP_FOR = 4
REAP_AT_LEAST = 1.0
PEERS_EVERY = 5.0
#: Between claims the thread looks at the relay's claims every PULSE_EVERY (no statement)
#: for this long after the last one, then sleeps until a claim wakes it: an idle relay's
#: pulse costs nothing.
WATCH_FOR = 1.0
#: After a failed pulse (the database away: the workers say so), the next try.
RETRY_AFTER = 1.0

# One statement: the pulse itself (its session's state_change moves at each), and the reaper.
# A worker session of another relay that sits idle in its transaction longer than $2 seconds,
# while that relay's pulse session has been idle as long, belongs to a stopped process: end it.
# A relay without a pulse session is never matched. pg_stat_activity is read once, at the
# statement's first look; the CTE is materialized so that nothing is ended before every
# condition was checked (PostgreSQL may evaluate a WHERE clause's terms in any order).
REAP = f"""
WITH frozen AS MATERIALIZED (
    SELECT w.pid, extract(epoch FROM clock_timestamp() - w.state_change)::float8 AS idle
    FROM pg_stat_activity AS w
    JOIN pg_stat_activity AS p
      ON p.datname = w.datname
     AND p.application_name = '{PULSE_APP}' || substr(w.application_name, {len(WORKER_APP) + 1})
    WHERE w.datname = current_database()
      AND w.application_name LIKE '{WORKER_APP}/%'
      AND w.application_name <> $1
      AND w.state = 'idle in transaction'
      AND w.state_change < clock_timestamp() - make_interval(secs => $2)
      AND p.state = 'idle'
      AND p.state_change < clock_timestamp() - make_interval(secs => $2)
)
SELECT pid, idle FROM frozen WHERE pg_terminate_backend(pid)
"""


# Other relays with a pulse, on this database: without one, there is no claim to end.
PEERS = f"""
SELECT count(*)::int FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE '{PULSE_APP}/%'
  AND application_name <> $1
"""


def worker_app(relay_id: str) -> str:
    """The ``application_name`` of a relay's worker sessions."""
    return f"{WORKER_APP}/{relay_id}"


def pulse_app(relay_id: str) -> str:
    """The ``application_name`` of a relay's pulse session."""
    return f"{PULSE_APP}/{relay_id}"


class Pulse:
    """The pulse thread of one relay. ``claim_started``, ``claim_ended`` and ``saw_busy``
    are called from the relay's event loop (each a few attribute writes, no lock: the thread
    only reads them); ``on_reaped(n)`` is called in that loop when the pulse ended ``n``
    claims of frozen relays."""

    def __init__(
        self,
        dsn: str,
        relay_id: str,
        timeout: float,
        *,
        command_timeout: float,
        on_reaped: Callable[[int], None],
    ) -> None:
        self._dsn = dsn
        self._worker_app = worker_app(relay_id)
        self._app = pulse_app(relay_id)
        self.timeout = timeout
        self._reap_for = max(REAP_AT_LEAST, REAP_FOR * timeout)
        self._command_timeout = command_timeout
        self._on_reaped = on_reaped
        never = -1e9
        self._open = 0  # claims open now
        self._open_since = never  # since when some claim has been open without a break
        self._ended_at = never  # when the last claim ended
        self._busy_at = never  # when a claim last met buckets held by others
        self._peers = 0  # other relays' pulse sessions, as of _peers_at
        self._peers_at = never
        self._stopped = False
        self._asleep = True  # the thread waits for a claim to wake it
        self._reaping = True
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the thread's
        self._wake: asyncio.Event | None = None  # the thread's, set only in its loop
        self._main: asyncio.AbstractEventLoop | None = None
        #: Statements sent, of them the reaper's, and claims ended (read by tests).
        self.pulses = 0
        self.reaps = 0
        self.reaped = 0

    # --- called in the relay's event loop ------------------------------------------------

    def start(self) -> None:
        self._main = asyncio.get_running_loop()
        self._thread = threading.Thread(
            target=self._thread_main, name="notify-outbox-pulse", daemon=True
        )
        self._thread.start()

    def claim_started(self) -> None:
        if self._open == 0:
            self._open_since = time.monotonic()
        self._open += 1
        if self._asleep:
            self._rouse()

    def claim_ended(self) -> None:
        self._open -= 1
        self._ended_at = time.monotonic()

    def saw_busy(self) -> None:
        self._busy_at = time.monotonic()
        if self._asleep:
            self._rouse()

    async def stop(self) -> None:
        """End the thread (and its connection)."""
        self._stopped = True
        self._rouse()
        thread = self._thread
        if thread is not None:
            # It ends within a beat, or after the connection attempt in flight (bounded by
            # the command timeout; a daemon thread, it holds no exit up).
            await asyncio.to_thread(thread.join, min(2.0, self._command_timeout + 1))

    def _rouse(self) -> None:
        self._asleep = False
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the thread's loop has closed
                loop.call_soon_threadsafe(wake.set)

    # --- the thread ----------------------------------------------------------------------

    def _state(self) -> tuple[str, float]:
        """What the thread does next, and how long it then waits: "beat" (a statement),
        "peers" (look up other relays' pulses: a statement too), "watch" (look again) or
        "sleep" (until a claim wakes it)."""
        now = time.monotonic()
        if self._open > 0 and now - self._open_since >= BEAT_AFTER:
            return "beat", PULSE_EVERY
        if now - self._busy_at < self._reap_for:
            if now - self._peers_at >= PEERS_EVERY:
                return "peers", 0.0
            if self._peers:
                return "beat", REAP_EVERY
            return "watch", PULSE_EVERY
        if self._open > 0 or now - self._ended_at < WATCH_FOR:
            return "watch", PULSE_EVERY
        return "sleep", 0.0

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._run())
        except Exception:  # never silently: a relay without a pulse only loses the speed-up
            log.exception(
                "the relay's pulse stopped; frozen relays' claims now wait for claim_idle_timeout"
            )

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        conn: asyncpg.Connection | None = None
        first = True
        try:
            while not self._stopped:
                state, wait = self._state()
                # The pulse session must exist before a claim could freeze: a relay without
                # one is never taken for frozen. Opened at start, and again once claims come.
                if (first or state != "sleep") and (conn is None or conn.is_closed()):
                    first = False
                    try:
                        conn = await self._connect()
                    except DATABASE_ERRORS:
                        # The workers report the database's outages; the pulse tries again.
                        conn = None
                        await asyncio.sleep(RETRY_AFTER)
                        continue
                if state == "sleep":
                    self._wake.clear()
                    self._asleep = True
                    # A claim that began before the flag was set finds the thread awake;
                    # one after it wakes the thread (the GIL orders the two).
                    if self._state()[0] == "sleep" and not self._stopped:
                        await self._wake.wait()
                    self._asleep = False
                    continue
                if state == "watch":
                    await asyncio.sleep(wait)
                    continue
                assert conn is not None
                try:
                    if state == "peers":
                        self._peers = await conn.fetchval(PEERS, self._app)
                        self._peers_at = time.monotonic()
                        self.pulses += 1  # a statement: it proves this process runs too
                    else:
                        await self._beat(conn)
                except DATABASE_ERRORS:
                    conn.terminate()
                    conn = None
                    continue
                await asyncio.sleep(wait)
        finally:
            if conn is not None:
                conn.terminate()

    async def _connect(self) -> asyncpg.Connection:
        return await asyncpg.connect(
            self._dsn,
            timeout=self._command_timeout,
            statement_cache_size=4,
            command_timeout=self._command_timeout,
            server_settings=session_parameters(self._app),
        )

    async def _beat(self, conn: asyncpg.Connection) -> None:
        if not self._reaping:
            await conn.execute("SELECT 1")
            self.pulses += 1
            return
        try:
            ended = await conn.fetch(REAP, self._worker_app, self.timeout)
            self.reaps += 1
        except asyncpg.InsufficientPrivilegeError as e:
            self._reaping = False
            log.warning(
                "this relay may not end other relays' sessions (%s): a frozen relay's keys "
                "wait for its claim_idle_timeout. Run the relays as one role, or grant it "
                "pg_signal_backend",
                e,
            )
            return
        self.pulses += 1
        if ended:
            self.reaped += len(ended)
            log.info(
                "ended %d claim(s) of a relay that did not run for %.2fs (pulse silent: "
                "frozen); their keys go on here",
                len(ended),
                max(r["idle"] for r in ended),
            )
            main = self._main
            if main is not None:
                with contextlib.suppress(RuntimeError):  # the relay's loop has closed
                    main.call_soon_threadsafe(self._on_reaped, len(ended))
