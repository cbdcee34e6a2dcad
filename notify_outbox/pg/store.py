"""Claiming and marking rows: the relay's side of the outbox table.

``PgOutboxStore`` implements the relay's ``OutboxStore`` port (``core/outbox.py``) with
asyncpg. A claim is one transaction: the claimed rows stay locked while they are published,
and the outcome (published, retry later, dead-letter) is written in the same transaction, so a
crashed relay's rows simply become claimable again when its connection goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from operator import attrgetter

import asyncpg

from notify_outbox.core.errors import ClaimLost, MigrationError
from notify_outbox.core.outbox import BatchOutcome, ClaimedBatch, OutboxRow, OutboxStore

from .db import read_only, terminate
from .deadletters import DeadLetterFilter, purge
from .sqlfiles import Queries

log = logging.getLogger("notify_outbox.store")

__all__ = [
    "BatchOutcome",
    "ClaimedBatch",
    "LowWaterMark",
    "MarkKeeper",
    "OutboxRow",
    "OutboxStore",
    "PgOutboxStore",
]


_ATTEMPTS = attrgetter("attempts")


# A claim chooses its key buckets among this many rows per row it may take at the head of the
# queue (migration 0005): enough to reach buckets that no sibling claim owns while a backlog
# drains, and a bound on that look when they own everything in reach (the claim then comes
# back short, and the worker rests). It also bounds the rows a claim parks per bucket (0006).
CLAIM_SCAN_FACTOR = 10
# ... but no more than this many beyond twice the claim: the look stays short for large claims,
# and so does a claim that parks (it parks at most half its scan: about 50 ms per 1,000 rows
# here; 5,000 per claim let healthy rows behind 100,000 failing ones wait over a second).
CLAIM_SCAN_CAP = 2000


def claim_scan(limit: int) -> int:
    """How many head rows a claim of ``limit`` rows may look at (see CLAIM_SCAN_FACTOR)."""
    return min(limit * CLAIM_SCAN_FACTOR, max(CLAIM_SCAN_CAP, 2 * limit))


@dataclass(frozen=True, slots=True)
class LowWaterMark:
    """Where a claim's scans start (migration 0006): every fresh row has an id >= ``low``, or
    was written by one of ``xids``, transactions that were still running when the mark was
    set, with ids >= its entry in ``lows``. The database turns it into a floor at each
    statement's own snapshot. The first mark, 0, makes the first claim read from the start."""

    low: int = 0
    xids: tuple[int, ...] = ()
    lows: tuple[int, ...] = ()

    def args(self) -> tuple[int, list[int], list[int]]:
        """The mark as query parameters."""
        return self.low, list(self.xids), list(self.lows)

    def literal(self) -> str:
        """The mark as SQL literals, for statements sent in the simple protocol: built from
        integers only (``int()`` guards it), never from text."""
        xids = ",".join(str(int(x)) for x in self.xids)
        lows = ",".join(str(int(x)) for x in self.lows)
        return f"{int(self.low)}, '{{{xids}}}'::bigint[], '{{{lows}}}'::bigint[]"


class MarkKeeper:
    """One relay's low-water mark, shared by its workers. Each claim starts from the current
    mark and returns the next; the next is installed only if no other claim installed one
    meanwhile (every mark a claim returns is valid on its own, but a claim that started from
    an older one may know less, so it is simply dropped)."""

    def __init__(self) -> None:
        self.mark = LowWaterMark()
        self._version = 0

    def take(self) -> tuple[LowWaterMark, int]:
        """The mark to start a claim from, and a token for ``offer``."""
        return self.mark, self._version

    def offer(self, mark: LowWaterMark, token: int) -> None:
        """Install the mark a claim returned, unless another claim did since ``take``."""
        if token == self._version:
            self.mark = mark
            self._version += 1

    def reset(self) -> None:
        """Start again from the first mark (the next claim reads the queue from its start);
        marks of claims under way are dropped."""
        self.mark = LowWaterMark()
        self._version += 1


class _PgBatch:
    def __init__(
        self,
        conn: asyncpg.Connection,
        queries: Queries,
        rows: list[OutboxRow],
        *,
        delete: bool,
        full: bool,
        marks: MarkKeeper,
        busy: int,
        parked: bool,
        sent_at: float,
        prime: str | None = None,
    ) -> None:
        self._conn = conn
        self._q = queries
        self._rows = rows
        self._delete = delete
        self._full = full  # the claim got all it asked for: more is likely due
        self._marks = marks
        self.busy = busy
        self.parked = parked
        self.committed = False
        self._more_due: bool | None = None
        # When the claim's last statement was sent: the server cannot have been idle in the
        # claim for longer than since then (it went idle once it had answered).
        self._sent_at = sent_at
        #: How long the claim may have sat idle before its latest statement was sent (s).
        self.idle_before = 0.0
        # Sent right after the COMMIT when set: the next claim's BEGIN (PgOutboxStore.claim).
        self._prime = prime
        #: The COMMIT was followed by the next claim's BEGIN.
        self.primed = False

    def idle(self) -> float:
        return time.monotonic() - self._sent_at

    def _sending(self) -> None:
        now = time.monotonic()
        self.idle_before = now - self._sent_at
        self._sent_at = now

    @property
    def rows(self) -> Sequence[OutboxRow]:
        return self._rows

    @property
    def more_due(self) -> bool | None:
        return self._more_due

    async def keepalive(self) -> None:
        self._sending()
        await self._conn.execute("SELECT 1")

    async def complete(self, outcome: BatchOutcome) -> None:
        self._sending()
        if outcome.retry:
            ids, errors, delays = zip(*outcome.retry, strict=True)
            await self._conn.execute(
                self._q["record_failures"], list(ids), list(errors), list(delays)
            )
        if outcome.dead:
            ids, errors = zip(*outcome.dead, strict=True)
            await self._conn.execute(self._q["dead_letter"], list(ids), list(errors))
        # A retried row published, or any row dead-lettered, no longer holds its key's later
        # rows back: its key's next parked row is due (migration 0006). Rare: failures only.
        if outcome.dead or any(map(_ATTEMPTS, self._rows)):
            published, dead = set(outcome.published), {i for i, _ in outcome.dead}
            after = {
                r.key: r.id
                for r in self._rows
                if r.key is not None and (r.id in dead or (r.attempts and r.id in published))
            }
            if after:
                keys = sorted(after)
                await self._conn.execute(self._q["promote_next"], keys, [after[k] for k in keys])
        # The common path is one round trip: mark, COMMIT and a look for more, sent together
        # in the simple protocol (which takes no parameters: the ids are rendered as an
        # integer literal; int() guards that they are nothing else). After a full claim the
        # look is skipped: the worker claims again anyway, and the claim finds out.
        # A full claim whose every row was settled leaves more behind, very likely: skip the
        # look (the worker claims again anyway). Rows left as they were (held back behind a
        # failed row of their key) are not due: the look says whether anything else is.
        settled = len(outcome.published) + len(outcome.retry) + len(outcome.dead)
        full = self._full and settled == len(self._rows)
        sql = "COMMIT;"
        if self._prime is not None:
            # The look, if any, then runs in that new transaction: a SELECT in READ COMMITTED
            # leaves it holding no snapshot, no transaction id and no lock.
            sql += "\n" + self._prime + ";"
        if not full:
            sql += "\n" + self._q["look"].replace("<horizon>", self._marks.mark.literal())
        if outcome.published:
            query = "delete_published" if self._delete else "mark_published"
            literal = "{" + ",".join(map(str, map(int, outcome.published))) + "}"
            sql = self._q[query].replace("<ids>", literal) + "\n" + sql
        status = await self._conn.execute(sql)
        self.committed = True
        self.primed = self._prime is not None
        self._more_due = True if full else status != "SELECT 0"


# The claim's leading columns are OutboxRow's fields, in order (the SQL function's RETURNS TABLE).
_ROW_FIELDS = tuple(f.name for f in fields(OutboxRow))
_ROW_COLUMNS = len(_ROW_FIELDS)


def _check_row_columns(columns: Iterable[str]) -> None:
    """Refuse a claim whose columns are not OutboxRow's fields by name and order: rows are
    built by position, so a drift between the SQL and the dataclass would shift values."""
    got = tuple(columns)[:_ROW_COLUMNS]
    if got != _ROW_FIELDS:
        raise MigrationError(
            f"the claim returns the columns {', '.join(got)}, where OutboxRow has "
            f"{', '.join(_ROW_FIELDS)}: the database's claim function and this relay disagree"
        )


# Errors after which a claim's connection is suspect (a timed-out statement on a socket that
# may be silently dead, a protocol left mid-operation): the claim ends the session instead of
# rolling back on it.
_BROKEN: tuple[type[Exception], ...] = (
    OSError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)


def lost_after(idle_timeout: float, reaped_after: float | None) -> float:
    """How long a claim may sit idle before it may have been ended: by PostgreSQL (its idle
    timeout) or by another relay's pulse (``reaped_after``, pulse.py), whichever comes first."""
    return idle_timeout if reaped_after is None else min(idle_timeout, reaped_after)


def _claim_lost(rows: int, idle: float, timeout: float, reaped_after: float | None) -> ClaimLost:
    if idle >= 0.9 * timeout or reaped_after is None:
        return ClaimLost(
            f"a claim of {rows} rows sat idle {idle:.2f}s, beyond its idle timeout "
            f"({timeout:.2f}s), and PostgreSQL ended it: this relay did not run for that long "
            "(frozen, or starved of CPU). The next claim takes its rows; if they had been "
            "sent, they are sent again (duplicates). If the relay was only slow, raise "
            "NOTIFY_OUTBOX_CLAIM_IDLE_TIMEOUT"
        )
    return ClaimLost(
        f"a claim of {rows} rows sat idle {idle:.2f}s, and another relay ended it: this "
        "process did not run for that long, its pulse silent beyond its tolerance "
        f"(NOTIFY_OUTBOX_FROZEN_RELAY_TIMEOUT, {reaped_after:.2f}s, or three times the worst "
        "recent delay of its pulse: frozen, or starved worse than ever in the last seconds). "
        "The next claim takes its rows; if they had been sent, they are sent again "
        "(duplicates). If the process was only slow, raise NOTIFY_OUTBOX_FROZEN_RELAY_TIMEOUT"
    )


# The session is gone or suspect: ended, never handed out again.
_BROKEN_OR_LOST: tuple[type[Exception], ...] = (*_BROKEN, ClaimLost)

# What a statement on a session the server has ended raises (25P03 is the idle timeout's
# FATAL, 57P01 pg_terminate_backend's, when asyncpg reads it before it sees the socket closed).
_SESSION_GONE: tuple[type[Exception], ...] = (
    *_BROKEN,
    asyncpg.PostgresConnectionError,
    asyncpg.IdleInTransactionSessionTimeoutError,
    asyncpg.AdminShutdownError,
)


def _open_in_transaction(conn: asyncpg.Connection) -> bool:
    """Whether the session is open and inside a transaction; a connection asyncpg has already
    given back to its pool (it closed it after the server ended the session) is neither."""
    try:
        return not conn.is_closed() and conn.is_in_transaction()
    except asyncpg.InterfaceError:
        return False


async def _rollback(conn: asyncpg.Connection) -> None:
    """Roll a failed claim back; if even that fails, end the session (which rolls back)."""
    if not _open_in_transaction(conn):
        return
    try:
        await conn.execute("ROLLBACK")
    except Exception:
        # asyncpg may have ended the connection itself (and handed it back to the pool):
        # the error to report is the claim's, not terminate()'s complaint about that.
        with contextlib.suppress(asyncpg.InterfaceError):
            await terminate(conn)


# How long a worker's connection may wait, in a transaction begun ahead of its next claim, for
# that claim (PgOutboxStore.claim), at most (s); and at most half the claim's idle timeout,
# which that transaction carries already.
PRIME_TTL = 0.05


@dataclass(slots=True)
class _Primed:
    conn: asyncpg.Connection
    timeout_ms: int  # the idle_in_transaction_session_timeout its BEGIN set
    until: float  # time.monotonic() after which it is rolled back and goes back to the pool


class PgOutboxStore:
    """``OutboxStore`` on an asyncpg pool (worker connections; never the listener's).

    ``prime``: a claim that committed while claims keep coming sends the next claim's BEGIN in
    its COMMIT's round trip, and keeps its connection for a moment (``prime_ttl``): a claim
    that comes meanwhile starts without a round trip of its own. Measured on this project's
    2-core VM with one event per claim every 10 ms: 0.10-0.13 ms less per claim, and about
    100 µs less CPU (client and server). The transaction waits holding no snapshot, no
    transaction id and no lock (READ COMMITTED, nothing written); it does show as ``idle in
    transaction`` meanwhile. Not behind a transaction pooler, where it would hold a server
    connection."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        queries: Queries,
        *,
        delete_on_publish: bool,
        command_timeout: float,
        begin_round_trip: Callable[[float], None] | None = None,
        prime: bool = False,
        prime_ttl: float = PRIME_TTL,
        server_started: datetime | None = None,
    ) -> None:
        self._pool = pool
        # READ COMMITTED whatever the database's default: the claim needs a new snapshot per
        # statement (migrations 0005 and 0006).
        self._begin = "BEGIN ISOLATION LEVEL READ COMMITTED"
        #: Told how long each claim's BEGIN took (the relay's claim timeout learns from it).
        self._begin_round_trip = begin_round_trip
        self._q = queries
        self._delete = delete_on_publish
        self._timeout = command_timeout
        #: The relay's low-water mark (migration 0006), advanced by every claim.
        self.marks = MarkKeeper()
        # When the server the mark was learnt on started (pg_postmaster_start_time): the
        # fallback poll reads it again (see poll()).
        self._server_started = server_started
        #: Set while the relay pulses (pulse.py): another relay ends a claim of this one that
        #: sat idle this long while this process did not run.
        self.reaped_after: float | None = None
        self._columns_checked = False
        self._prime = prime
        self._prime_ttl = prime_ttl
        self._primed: list[_Primed] = []
        self._expiry: asyncio.TimerHandle | None = None
        self._unpriming: set[asyncio.Task[None]] = set()
        # Moves on when the server turned read-only: a transaction primed before that may still
        # write, and a claim on it would look like the server came back.
        self._epoch = 0

    def _take_primed(self) -> _Primed | None:
        """The most recently primed connection still fresh, if any."""
        now = time.monotonic()
        while self._primed:
            primed = self._primed.pop()
            if primed.until > now and not primed.conn.is_closed():
                return primed
            self._unprime(primed.conn)
        return None

    def _keep_primed(self, conn: asyncpg.Connection, timeout_ms: int, ttl: float) -> None:
        self._primed.append(_Primed(conn, timeout_ms, time.monotonic() + ttl))
        if self._expiry is None:
            self._expiry = asyncio.get_running_loop().call_later(ttl, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        now = time.monotonic()
        fresh = []
        for primed in self._primed:
            if primed.until > now:
                fresh.append(primed)
            else:
                self._unprime(primed.conn)
        self._primed = fresh
        if fresh:
            soonest = min(p.until for p in fresh)
            self._expiry = asyncio.get_running_loop().call_later(soonest - now, self._expire)

    def _unprime(self, conn: asyncpg.Connection) -> None:
        task = asyncio.get_running_loop().create_task(self._roll_back_and_release(conn))
        self._unpriming.add(task)
        task.add_done_callback(self._unpriming.discard)

    async def _roll_back_and_release(self, conn: asyncpg.Connection) -> None:
        try:
            if _open_in_transaction(conn):
                await conn.execute("ROLLBACK", timeout=self._timeout)
        except Exception:
            with contextlib.suppress(asyncpg.InterfaceError):
                await terminate(conn)
        finally:
            with contextlib.suppress(Exception):
                await self._pool.release(conn)

    async def close(self) -> None:
        """Give primed connections back to the pool (before it closes: it waits for them)."""
        self._prime = False
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        while self._primed:
            self._unprime(self._primed.pop().conn)
        if self._unpriming:
            await asyncio.gather(*self._unpriming, return_exceptions=True)

    @asynccontextmanager
    async def claim(
        self, limit: int, idle_timeout: float | None = None
    ) -> AsyncIterator[ClaimedBatch]:
        # The transaction is driven by hand rather than by asyncpg's transaction(), so that
        # the outcome, the COMMIT and the look for more share one round trip (complete()).
        begin = self._begin
        ms = None
        if idle_timeout is not None:
            # SET LOCAL, not a session setting: it must also hold behind a transaction
            # pooler, and it rides in BEGIN's round trip (simple protocol, a number: no
            # parameters).
            ms = max(1, round(idle_timeout * 1000))
            begin += f"; SET LOCAL idle_in_transaction_session_timeout = {ms}"
        epoch = self._epoch
        primed = self._take_primed() if self._prime else None
        conn = primed.conn if primed is not None else await self._pool.acquire()
        keep = False
        try:
            try:
                started = time.monotonic()
                if primed is None:
                    await conn.execute(begin)
                    if self._begin_round_trip is not None:
                        self._begin_round_trip(time.monotonic() - started)
                elif ms is not None and ms != primed.timeout_ms:
                    await conn.execute(f"SET LOCAL idle_in_transaction_session_timeout = {ms}")
                start, token = self.marks.take()
                sent_at = time.monotonic()
                records = await conn.fetch(
                    self._q["claim"],
                    limit,
                    claim_scan(limit),
                    *start.args(),
                    timeout=self._timeout,
                )
                # The last row carries the next mark, and whether the claim parked or promoted
                # rows (to keep even if it claimed none); the others are rows, their columns in
                # OutboxRow's field order (checked by name once: a row is built by position, the
                # hot path).
                last = records[-1]
                if not self._columns_checked:
                    _check_row_columns(last.keys())
                    self._columns_checked = True
                mark = LowWaterMark(
                    last["next_low"], tuple(last["next_xids"]), tuple(last["next_lows"])
                )
                self.marks.offer(mark, token)
                changed = bool(last["changed"])
                busy = int(last["busy"])
                rows = [OutboxRow(*r[:_ROW_COLUMNS]) for r in records[:-1]]
                # Prime the next claim when this one got rows (more are likely soon), and its
                # connection may wait for it well within the claim's idle timeout.
                ttl = self._prime_ttl
                if idle_timeout is not None:
                    ttl = min(ttl, idle_timeout / 2)
                batch = _PgBatch(
                    conn,
                    self._q,
                    rows,
                    delete=self._delete,
                    full=len(rows) >= limit,
                    marks=self.marks,
                    busy=busy,
                    parked=changed,
                    sent_at=sent_at,
                    prime=begin if self._prime and rows else None,
                )
                try:
                    yield batch
                except Exception as e:
                    if (
                        idle_timeout is not None
                        and batch.idle_before >= 0.9 * lost_after(idle_timeout, self.reaped_after)
                        and isinstance(e, _SESSION_GONE)
                    ):
                        raise _claim_lost(
                            len(rows), batch.idle_before, idle_timeout, self.reaped_after
                        ) from e
                    if isinstance(e, _BROKEN):
                        # Ended below without a ROLLBACK: after a timeout, asyncpg sends the
                        # ROLLBACK only once the server acknowledged its cancel request,
                        # which a silent socket never does (a second db_command_timeout of
                        # waiting).
                        raise
                    await _rollback(conn)
                    raise
                if not batch.committed:  # the caller did not complete it: rows unchanged
                    await conn.execute("COMMIT" if changed else "ROLLBACK")
                elif batch.primed and _open_in_transaction(conn):
                    keep = True  # the connection is handed on: kept primed, or rolled back
                    if self._prime and self._epoch == epoch:
                        self._keep_primed(conn, ms if ms is not None else 0, ttl)
                    else:  # closing, or the server turned read-only since the claim began
                        self._unprime(conn)
            except _BROKEN_OR_LOST:
                # The connection may be left mid-protocol (the pool's release no longer runs a
                # reset query that would have caught it): never hand it out again. (When the
                # server already ended it, the pool may have let go of it: nothing to end.)
                with contextlib.suppress(asyncpg.InterfaceError):
                    await terminate(conn)
                raise
            except BaseException as e:
                # Cancelled (possibly mid-statement): ending the session is the one sure and
                # immediate way to release the claim's locks; the pool opens a new one.
                if _open_in_transaction(conn):
                    await terminate(conn)
                if read_only(e):  # every pooled session is on that read-only server too
                    # Before any await: no other worker may take a primed one meanwhile.
                    self._epoch += 1
                    while self._primed:
                        self._unprime(self._primed.pop().conn)
                    await self._pool.expire_connections()
                raise
        finally:
            if not keep:
                await self._pool.release(conn)

    async def has_due(self) -> bool:
        mark = self.marks.mark
        return bool(
            await self._pool.fetchval(self._q["has_due"], *mark.args(), timeout=self._timeout)
        )

    async def poll(self) -> tuple[bool, float | None]:
        row = await self._pool.fetchrow(
            self._q["poll"], *self.marks.mark.args(), timeout=self._timeout
        )
        assert row is not None
        if row[2]:
            # A parked row is first of its key: what released it promoted nothing (its
            # earlier row was deleted by hand, or published by a relay of migration 0005).
            await self._pool.execute(self._q["promote_stuck"], timeout=self._timeout)
        due = bool(row[0])
        started: datetime | None = row[3]
        if started != self._server_started:
            if self._server_started is not None and self.server_changed():
                due = True  # claim now: rows whose marks were lost sit below the old mark
            self._server_started = started
        return due, None if row[1] is None else float(row[1])

    def server_changed(self) -> bool:
        """The server restarted, or another took over (a failover): drop the low-water mark.
        A failover to an asynchronous standby loses the transactions the standby had not
        received, claims' marks among them: their rows are pending again, below this relay's
        mark, and no claim from it would ever read them. True when a mark was dropped."""
        if self.marks.mark == LowWaterMark():
            return False
        self.marks.reset()
        log.warning(
            "the database server restarted or another took over: claims read the outbox from "
            "its start again (rows whose marks a failover lost are published again)"
        )
        return True

    async def count_pending(self, limit: int) -> int:
        return int(
            await self._pool.fetchval(
                self._q["count_pending"], limit, *self.marks.mark.args(), timeout=self._timeout
            )
        )

    async def delete_expired(self, older_than: float, limit: int) -> int:
        status = await self._pool.execute(
            self._q["delete_expired"], older_than, limit, timeout=self._timeout
        )
        return int(status.split()[-1])

    async def expire_dead_letters(self, older_than: float, limit: int) -> int:
        where = DeadLetterFilter(older_than=timedelta(seconds=older_than))
        return await purge(self._pool, self._q.names, where, batch=limit)

    async def notify(self, channel: str, payload: str) -> None:
        await self._pool.execute("SELECT pg_notify($1, $2)", channel, payload)
