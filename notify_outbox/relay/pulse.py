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
other claims, if other relays with a pulse are connected. A busy event loop does not silence
it (the thread needs the interpreter for microseconds, which it gets within the switch
interval, 5 ms); a stopped process does. The beat is the reaper: it ends
(``pg_terminate_backend``) the worker sessions of other relays that sat idle in their
transaction longer than their relay's tolerance (below) while their relay's pulse session was
idle as long. Their rows and key buckets are free at once, and the reaping relay wakes its
workers. Claims of a few milliseconds (the common case) cost no statement, and an idle
relay's pulse thread sleeps until a claim wakes it. A live relay's first beat comes at most
two ``PULSE_EVERY`` (50 ms) after its claim began.

A process starved of CPU is silenced too, for a while: a container at its CPU limit stops
for the rest of its quota's period, and on a saturated 2-core VM the pulse thread of a relay
beside sixteen busy loops woke up to 0.27 s late (0.38 s with the statement's round trip),
its relay's claims open. Taken for frozen after ``frozen_relay_timeout`` (0.15 s), such a
relay lost claims whose records had gone out, and they were published twice (issue #31:
9,592 messages for 9,589 events; relays throttled to 10% of a CPU each lost 14 to 39 claims
in a 10,000-event run, 93 to 273 repeats). So each relay's tolerance follows its own delays:

- the pulse thread notes how late each of its sleeps woke, and each statement's round trip
  (``Lateness``: the worst of its last 200 to 400 looks, taken only while it watches or
  beats, so an idle relay keeps its history and its pulse still costs nothing; a delay of
  ``TOLERANCE_CEILING`` or more is a freeze and does not count);
- its tolerance is ``FACTOR`` (3) times that worst delay, rounded up to 50 ms, between
  ``frozen_relay_timeout`` and ``TOLERANCE_CEILING`` (2 s: PostgreSQL's idle timeout ends a
  claim silent that long anyway). Every statement of the pulse starts with it
  (``/* notify-outbox tolerance_ms=N */``), where the other relays' reaper reads it in
  ``pg_stat_activity.query``; one that changed while the thread only looked is told at once;
- the reaper ends a relay's claim once it was silent for the longer of that relay's
  tolerance and its own: a reaper that ran late was starved, and so may its peers have been
  (a VM or a whole host stalled: the first to run again must not end the others' claims).
  Ages are counted to the reaper's statement's start, not to the moment it reads them.

A container at its CPU limit is stopped for up to the rest of its quota's period, each period
(a cgroup's ``cpu.max``, or ``cpu.cfs_quota_us`` in cgroup v1), from its first busy second on:
before its pulse could learn anything. A relay under such a quota reads the period at start and
takes ``QUOTA_FACTOR`` (2) periods as its least tolerance (100 ms periods, Kubernetes' default:
0.2 s): the first throttled claims are not ended by a peer. Measured: three relays, one in a
cgroup of 50 ms per 500 ms, 9,600 events: without this floor, claims were lost and 2 to 3
events published twice in 3 of 7 runs; with it, in none of 8.

A relay that never ran late (or whose delays stay under a third of the timeout: 50 ms) is
taken for frozen after ``frozen_relay_timeout``, as before; a relay that ran 0.3 s late in the
last few seconds of claims, after 0.9 s. What it cannot tell: a relay's first stall, worse
than any before it and longer than its tolerance, from a freeze (its claim may be ended), and
a freeze of a relay that was starved recently from a stall (its keys wait up to its
tolerance).

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
from pathlib import Path

import asyncpg

from notify_outbox.pg.db import DATABASE_ERRORS, session_parameters

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
#: A relay's tolerance: how long its pulse may be silent before a peer takes it for stopped.
#: FACTOR times the worst recent lateness of its pulse thread (a sleep that woke late, plus
#: the statement's round trip: what stretches the silence between two beats beyond
#: PULSE_EVERY), and never less than frozen_relay_timeout. The silence a live relay shows is
#: PULSE_EVERY plus its lateness of the moment: FACTOR times its worst keeps a stall up to
#: about 2.5 times worse than any recent one (or a first one up to the timeout less
#: PULSE_EVERY) from passing for a freeze.
FACTOR = 3.0
#: ... up to TOLERANCE_CEILING (PostgreSQL's claim_idle_timeout, 2 s by default, ends a claim
#: silent that long anyway). A delay this long or longer is a freeze (SIGSTOP, a VM pause),
#: not starvation: it does not count.
TOLERANCE_CEILING = 2.0
#: Recent: the worst of the last LATENESS_WINDOW to 2 x LATENESS_WINDOW samples (one per look
#: or statement of the thread, taken only while it watches or beats: 5 to 10 s of claims at
#: one per PULSE_EVERY). Counted in samples, not seconds: a throttled relay that idled for a
#: while remembers its stalls when claims come again.
LATENESS_WINDOW = 200
#: A relay under a CPU quota (cgroup) may be stopped for the rest of each period: QUOTA_FACTOR
#: periods is its least tolerance (two: the pulse thread may miss a period's run time while the
#: event loop's thread holds the GIL), up to TOLERANCE_CEILING.
QUOTA_FACTOR = 2.0
#: The tolerance carried in each statement is rounded up to this step (ms) beyond the
#: timeout: each value is a statement text of its own (prepared once, cached).
TOLERANCE_STEP_MS = 50

# Every statement of the pulse starts with this tag: the relay's tolerance (ms), read by the
# other relays' reaper in pg_stat_activity.query (the text of the session's last statement; at
# its start, so that track_activity_query_size cannot cut it). Only the pulse session of a
# relay carries it; a session without it (an older relay, a pulse that never beat) is held to
# the reaping relay's own tolerance.
TAG = "/* notify-outbox tolerance_ms={} */ "
_TAG_PATTERN = r"^/\* notify-outbox tolerance_ms=([0-9]{1,6}) \*/"

# One statement: the pulse itself (its session's state_change moves at each), and the reaper.
# A worker session of another relay that sits idle in its transaction longer than its
# relay's tolerance and this relay's ($2 seconds), whichever is longer, while that relay's
# pulse session has been idle as long, belongs to a stopped process: end it. A relay without
# a pulse session is never matched. pg_stat_activity is read once, at the statement's first
# look, and ages are counted to the statement's start, before that look: a reaper whose
# backend waits for a CPU between the look and the test sees the ages of that look, not ages
# stretched by its own wait. The CTE is materialized so that nothing is ended before every
# condition was checked (PostgreSQL may evaluate a WHERE clause's terms in any order).
REAP = f"""
WITH frozen AS MATERIALIZED (
    SELECT w.pid, extract(epoch FROM statement_timestamp() - w.state_change)::float8 AS idle
    FROM pg_stat_activity AS w
    JOIN pg_stat_activity AS p
      ON p.datname = w.datname
     AND p.application_name = '{PULSE_APP}' || substr(w.application_name, {len(WORKER_APP) + 1})
    CROSS JOIN LATERAL (
        SELECT make_interval(secs => greatest(
            $2::float8, coalesce(substring(p.query FROM '{_TAG_PATTERN}')::float8, 0) / 1000
        )) AS quiet
    ) AS tolerance
    WHERE w.datname = current_database()
      AND w.application_name LIKE '{WORKER_APP}/%'
      AND w.application_name <> $1
      AND w.state = 'idle in transaction'
      AND w.state_change < statement_timestamp() - tolerance.quiet
      AND p.state = 'idle'
      AND p.state_change < statement_timestamp() - tolerance.quiet
)
SELECT pid, idle FROM frozen WHERE pg_terminate_backend(pid)
"""


# Other relays with a pulse, on this database: without one, there is no claim to end.
PEERS = f"""
SELECT count(*)::int FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE '{PULSE_APP}/%'
  AND application_name <> $1
"""


def tagged(sql: str, tolerance: float) -> str:
    """``sql`` as the pulse sends it: with its relay's tolerance (seconds) for the reapers."""
    return TAG.format(round(tolerance * 1000)) + sql


class Lateness:
    """How late the pulse thread ran, recently: the worst of the last ``window`` to 2 x
    ``window`` samples, a delay of ``TOLERANCE_CEILING`` or more (a freeze) left out. Two
    buckets of ``window`` samples; O(1) per sample."""

    def __init__(self, window: int = LATENESS_WINDOW) -> None:
        self._window = window
        self._current = 0.0  # the worst of the bucket being filled
        self._previous = 0.0  # the worst of the bucket before it
        self._count = 0  # samples in the current bucket

    def add(self, seconds: float) -> None:
        if seconds >= TOLERANCE_CEILING:
            return
        if seconds > self._current:
            self._current = seconds
        self._count += 1
        if self._count >= self._window:
            self._previous, self._current, self._count = self._current, 0.0, 0

    def worst(self) -> float:
        return max(self._current, self._previous)


def tolerance_for(timeout: float, lateness: float) -> float:
    """How long a relay whose pulse thread was ``lateness`` late may go silent before a peer
    takes it for stopped: ``FACTOR`` times that, rounded up to ``TOLERANCE_STEP_MS``, at most
    ``TOLERANCE_CEILING``, never less than ``timeout`` (frozen_relay_timeout)."""
    steps = -(-round(FACTOR * lateness * 1000) // TOLERANCE_STEP_MS)
    return max(timeout, min(TOLERANCE_CEILING, steps * TOLERANCE_STEP_MS / 1000))


def cpu_quota_period(
    cgroups: str = "/proc/self/cgroup", mount: str = "/sys/fs/cgroup"
) -> float | None:
    """The period (seconds) of the CPU quota this process runs under, or None without one: the
    longest period of a quota set on its cgroup or an ancestor (a container's, a pod's), in
    cgroup v2 (``cpu.max``) or v1 (``cpu.cfs_quota_us``, ``cpu.cfs_period_us``). Unreadable
    files count as no quota."""
    try:
        lines = Path(cgroups).read_text().splitlines()
    except OSError:
        return None
    root = Path(mount)
    periods: list[float] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2: one hierarchy, at the mount point
            bases = [root]
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            # Where the controller is mounted: under its own name, or a joined one's (once each).
            bases = list(dict.fromkeys([root / controllers, root / "cpu", root / "cpu,cpuacct"]))
        else:
            continue
        for base in bases:
            for folder in _and_ancestors(base, path):
                periods.extend(_quota_period(folder))
    return max(periods) if periods else None


def _and_ancestors(base: Path, path: str) -> list[Path]:
    # In a container the mount is its own cgroup, while /proc/self/cgroup may name the host's
    # path: the mount point itself is looked at too.
    parts = [p for p in path.split("/") if p]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _quota_period(folder: Path) -> list[float]:
    try:
        if (folder / "cpu.max").exists():
            quota, period = (folder / "cpu.max").read_text().split()
            return [] if quota == "max" else [int(period) / 1e6]
        if (folder / "cpu.cfs_quota_us").exists():
            if int((folder / "cpu.cfs_quota_us").read_text()) < 0:
                return []
            return [int((folder / "cpu.cfs_period_us").read_text()) / 1e6]
    except (OSError, ValueError):
        pass
    return []


def least_tolerance(timeout: float, quota_period: float | None) -> float:
    """A relay's least tolerance: ``frozen_relay_timeout``, or ``QUOTA_FACTOR`` periods of its
    CPU quota if that is longer (up to ``TOLERANCE_CEILING``)."""
    if quota_period is None:
        return timeout
    return max(timeout, min(TOLERANCE_CEILING, QUOTA_FACTOR * quota_period))


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
        quota_period: Callable[[], float | None] = cpu_quota_period,
    ) -> None:
        self._dsn = dsn
        self._worker_app = worker_app(relay_id)
        self._app = pulse_app(relay_id)
        #: The least tolerance: frozen_relay_timeout, or two periods of a CPU quota.
        self.timeout = least_tolerance(timeout, quota_period())
        if self.timeout > timeout:
            log.info(
                "this relay runs under a CPU quota (cgroup): it may be stopped for the rest of "
                "each period, so other relays end its claims after %.2fs of silence at the "
                "least, not frozen_relay_timeout's %.2fs (pulse.py)",
                self.timeout,
                timeout,
            )
        self._untagged = timeout  # what peers take a session without a statement for
        self._reap_for = max(REAP_AT_LEAST, REAP_FOR * self.timeout)
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
        #: How late the thread ran recently (written by the thread only).
        self.lateness = Lateness()
        self._told = self.timeout  # the tolerance last logged
        self._carried = self.timeout  # the tolerance in the session's last statement

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

    def tolerance(self) -> float:
        """How long this relay's pulse may be silent before a peer takes it for stopped (and
        the least silence after which this relay's reaper ends a peer's claim): see
        ``tolerance_for``."""
        return tolerance_for(self.timeout, self.lateness.worst())

    def _rouse(self) -> None:
        self._asleep = False
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the thread's loop has closed
                loop.call_soon_threadsafe(wake.set)

    # --- the thread ----------------------------------------------------------------------

    def _state(self) -> tuple[str, float]:
        """What the thread does next, and how long it then waits: "beat" (a statement),
        "peers" (look up other relays' pulses: a statement too), "tell" (a statement that only
        carries a tolerance changed since the last one), "watch" (look again) or "sleep" (until
        a claim wakes it)."""
        now = time.monotonic()
        if self._open > 0 and now - self._open_since >= BEAT_AFTER:
            return "beat", PULSE_EVERY
        if now - self._busy_at < self._reap_for:
            if now - self._peers_at >= PEERS_EVERY:
                return "peers", 0.0
            if self._peers:
                return "beat", REAP_EVERY
            return self._watch()
        if self._open > 0 or now - self._ended_at < WATCH_FOR:
            return self._watch()
        return "sleep", 0.0

    def _watch(self) -> tuple[str, float]:
        # Peers read the tolerance in the last statement: one that changed while the thread
        # only looked (short claims) is told at once, before a claim could stall (rare: it
        # grows with a delay worse than any recent one, and comes down once that delay left
        # the window; a stale one kept a frozen relay's keys waiting longer than needed).
        if self.tolerance() != self._carried:
            return "tell", PULSE_EVERY
        return "watch", PULSE_EVERY

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
        late = 0.0  # how late the thread's last sleep woke (0 after a wake-up by a claim)
        try:
            while not self._stopped:
                state, wait = self._state()
                # The pulse session must exist before a claim could freeze: a relay without
                # one is never taken for frozen. Opened at start, and again once claims come.
                if (first or state != "sleep") and (conn is None or conn.is_closed()):
                    first = False
                    try:
                        conn = await self._connect()
                        # A session without a statement is held to its peers' own tolerance
                        # (frozen_relay_timeout, as a rule): one above it (a CPU quota's, a
                        # learned one) is told now, before a claim could stall unannounced.
                        self._carried = self._untagged
                        if self.tolerance() != self._carried:
                            told = self.tolerance()
                            await conn.execute(tagged("SELECT 1", told))
                            self._carried = told
                    except DATABASE_ERRORS:
                        # The workers report the database's outages; the pulse tries again.
                        if conn is not None:
                            conn.terminate()
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
                    late = 0.0
                    continue
                if state == "watch":
                    self._late(await self._sleep(wait))
                    continue
                assert conn is not None
                # The statement carries the tolerance with the sleep's delay in it already: a
                # reaper that has just been starved does not end peers starved with it.
                tolerance = tolerance_for(self.timeout, max(self.lateness.worst(), late))
                sent = time.monotonic()
                try:
                    if state == "peers":
                        sql = tagged(PEERS, tolerance)
                        self._peers = await conn.fetchval(sql, self._app)
                        self._peers_at = time.monotonic()
                    elif state == "tell":
                        await conn.execute(tagged("SELECT 1", tolerance))
                    else:
                        await self._beat(conn, tolerance)
                    # A statement: it proves this process runs, and carries its tolerance.
                    self.pulses += 1
                    self._carried = tolerance
                except DATABASE_ERRORS:
                    conn.terminate()
                    conn = None
                    continue
                # One sample per beat: what stretched the silence before it beyond the beat's
                # interval, the sleep's delay and the round trip (a starved process, or
                # server, stretches both).
                self._late(late + time.monotonic() - sent)
                late = await self._sleep(wait) if wait else 0.0
        finally:
            if conn is not None:
                conn.terminate()

    @staticmethod
    async def _sleep(seconds: float) -> float:
        """Sleep; returns how late the thread woke."""
        start = time.monotonic()
        await asyncio.sleep(seconds)
        return max(0.0, time.monotonic() - start - seconds)

    def _late(self, seconds: float) -> None:
        self.lateness.add(seconds)
        # Operators see the tolerance move when it doubles or halves, with the delay behind it.
        now = self.tolerance()
        if now >= 2 * self._told or now <= self._told / 2:
            log.info(
                "this relay's pulse thread ran up to %.3fs late recently: other relays now "
                "end its claims after %.2fs of silence, and it theirs (pulse.py)",
                self.lateness.worst(),
                now,
            )
            self._told = now

    async def _connect(self) -> asyncpg.Connection:
        return await asyncpg.connect(
            self._dsn,
            timeout=self._command_timeout,
            # Each tolerance is a statement text of its own (TOLERANCE_STEP_MS apart): the
            # ones of a relay's recent stalls stay prepared.
            statement_cache_size=16,
            command_timeout=self._command_timeout,
            server_settings=session_parameters(self._app),
        )

    async def _beat(self, conn: asyncpg.Connection, tolerance: float) -> None:
        if not self._reaping:
            await conn.execute(tagged("SELECT 1", tolerance))
            return
        try:
            # Its own tolerance, also the least silence it ends: a reaper that ran late was
            # starved, and so may its peers have been, with the whole host.
            ended = await conn.fetch(tagged(REAP, tolerance), self._worker_app, tolerance)
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
