"""In-memory fakes of the relay's two ports, for fast unit tests of its logic. They are never
used by the integration tests, which talk to the real PostgreSQL and Kafka; ``FakeStore`` is
held to ``PgOutboxStore``'s behaviour by the stores' contract suite (``tests/contract/``)."""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

import anyio

from notify_outbox import OutboxSettings
from notify_outbox.core.outbox import BatchOutcome, ClaimedBatch, OutboxRow
from notify_outbox.kafka.publisher import PublishResult

#: A row parked behind a failed row of its key (PostgreSQL's next_attempt_at = 'infinity').
PARKED = math.inf

#: What a claim owns for a row (PostgreSQL's key bucket, without hash collisions): its key, or
#: the row itself when it has none.
Group = tuple[str, str | int]


@dataclass
class FakeRow:
    row: OutboxRow
    published: bool = False
    #: The dead letter's error, once the row was dead-lettered.
    dead: str | None = None
    #: When the row may be claimed again, in store time (``FakeStore.now``): None while it is
    #: fresh (never failed); set by a retry (or a test); ``PARKED`` while it waits behind a
    #: failed row of its key. PostgreSQL's ``next_attempt_at``.
    next_attempt: float | None = None
    errors: list[str] = field(default_factory=list)
    #: When it was published, in store time (for ``delete_expired``).
    published_at: float | None = None
    #: When it was dead-lettered, in store time (for ``expire_dead_letters``).
    dead_at: float | None = None

    def waits(self, now: float) -> bool:
        """Whether it waits for its retry time (not due yet, and not parked)."""
        return self.next_attempt is not None and now < self.next_attempt < PARKED


class FakeBatch:
    def __init__(
        self,
        store: FakeStore,
        rows: list[OutboxRow],
        limit: int,
        *,
        groups: set[Group],
        busy: int,
        parked: bool,
    ) -> None:
        self._store = store
        self._rows = rows
        self._limit = limit
        #: What the claim owns until it commits or ends (``_group``).
        self.groups = groups
        self.outcome: BatchOutcome | None = None
        self.keepalives = 0
        self.busy = busy
        self.parked = parked
        self.committed = False
        self._more_due: bool | None = None

    @property
    def rows(self) -> Sequence[OutboxRow]:
        return self._rows

    @property
    def more_due(self) -> bool | None:
        return self._more_due

    async def complete(self, outcome: BatchOutcome) -> None:
        # The claim commits here, as PgOutboxStore's does: what comes after cannot undo it.
        self.outcome = outcome
        self._store._apply(outcome, self._rows)
        self.committed = True
        self._store._open.discard(self)
        # As PgOutboxStore: a full claim whose every row was settled says "more" without a
        # look; otherwise the look after the commit says whether anything is due.
        settled = len(outcome.published) + len(outcome.retry) + len(outcome.dead)
        full = len(self._rows) >= self._limit and settled == len(self._rows)
        self._more_due = True if full else await self._store.has_due()

    async def keepalive(self) -> None:
        self.keepalives += 1

    def idle(self) -> float:
        return 0.0


def _group(r: FakeRow) -> Group:
    return ("key", r.row.key) if r.row.key is not None else ("row", r.row.id)


class FakeStore:
    """``OutboxStore`` in memory, claiming as the SQL does (migrations 0005 and 0006), and held
    to the same contract as ``PgOutboxStore`` by ``tests/contract/``: a claim owns keys (the
    SQL's key buckets, one per key here), takes each key's earliest pending rows with no gap,
    at most ``limit`` rows in all, and skips keys other open claims own (``busy``). A failed
    row holds its key's later rows back: a claim parks them, and they follow once it is
    published or dead-lettered (a due retry is claimed alone). ``complete`` commits the
    outcome; a claim left without it (or with an error) changes nothing but the rows it parked
    (which an error undoes too)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.rows: dict[int, FakeRow] = {}
        #: The claims not committed or ended yet.
        self._open: set[FakeBatch] = set()
        self._next_id = 1
        self._clock = clock
        self._now = 0.0
        self.claims = 0
        #: The idle timeout each claim was given (the relay's ClaimIdleTimeout).
        self.idle_timeouts: list[float | None] = []
        self.batches: list[FakeBatch] = []
        #: Added to every claim's ``busy`` (buckets held by other claims, as another relay's
        #: claims would hold them).
        self.busy = 0
        self.notified: list[tuple[str, str]] = []

    @property
    def now(self) -> float:
        """The store's time: frozen (set by the test) unless a clock was given."""
        return self._clock() if self._clock is not None else self._now

    @now.setter
    def now(self, value: float) -> None:
        self._now = value

    def add(self, topic: str = "t", key: str | None = None, payload: str = "{}") -> int:
        row_id = self._next_id
        self._next_id += 1
        self.rows[row_id] = FakeRow(
            OutboxRow(row_id, uuid.uuid4(), topic, key, payload, None, None)
        )
        return row_id

    @property
    def locked(self) -> set[int]:
        """The ids of the rows open claims hold."""
        return {r.id for b in self._open for r in b.rows}

    def pending(self) -> list[FakeRow]:
        return [r for _, r in sorted(self.rows.items()) if not r.published and r.dead is None]

    def _first_waiting(self, pending: list[FakeRow]) -> dict[str, int]:
        """Each key's earliest waiting row (failed, or parked behind one): the key's later
        rows are held back."""
        first: dict[str, int] = {}
        for r in pending:
            if r.row.key is not None and r.next_attempt is not None:
                first.setdefault(r.row.key, r.row.id)
        return first

    @asynccontextmanager
    async def claim(
        self, limit: int, idle_timeout: float | None = None
    ) -> AsyncIterator[ClaimedBatch]:
        self.claims += 1
        self.idle_timeouts.append(idle_timeout)
        now = self.now
        pending = self.pending()
        first_waiting = self._first_waiting(pending)
        others = {g for b in self._open for g in b.groups}
        mine: set[Group] = set()
        taken: list[FakeRow] = []
        changed: list[tuple[FakeRow, float | None]] = []  # (row, its next_attempt before)
        run_keys: set[str] = set()
        busy = 0

        def held(r: FakeRow) -> bool:
            return r.row.key is not None and first_waiting.get(r.row.key, r.row.id) < r.row.id

        def own(r: FakeRow) -> bool:
            if _group(r) in others:
                return False
            mine.add(_group(r))
            return True

        def set_next(r: FakeRow, value: float) -> None:
            changed.append((r, r.next_attempt))
            r.next_attempt = value

        # Due rows, each its key's earliest waiting row: a retry whose time came goes alone; a
        # promoted row takes its key's following waiting rows as one run, and the row after
        # the run is promoted.
        for r in pending:
            if len(taken) >= limit:
                break
            if r.next_attempt is None or r.next_attempt > now or held(r) or not own(r):
                continue
            taken.append(r)
            if r.row.key is None or r.row.attempts:
                continue
            later = [
                w
                for w in pending
                if w.row.key == r.row.key and w.row.id > r.row.id and w.next_attempt is not None
            ]
            run = 0
            for w in later:
                if len(taken) >= limit or w.waits(now):
                    break
                taken.append(w)
                run += 1
            if run < len(later) and later[run].next_attempt == PARKED:
                set_next(later[run], now)
            run_keys.add(r.row.key)

        # Fresh rows, a key at a time in order of its first one (a keyless row alone): each
        # key's earliest rows up to the limit; rows held back behind a failed row of their key
        # are parked instead (unless they wait for a run this claim took).
        groups: dict[Group, list[FakeRow]] = {}
        for r in pending:
            if r.next_attempt is None:
                groups.setdefault(_group(r), []).append(r)
        for rows in groups.values():
            if len(taken) >= limit:
                break
            if not own(rows[0]):
                busy += 1
                continue
            for r in rows:
                if held(r):
                    if r.row.key not in run_keys:
                        set_next(r, PARKED)
                elif len(taken) < limit:
                    taken.append(r)

        taken.sort(key=lambda r: r.row.id)
        batch = FakeBatch(
            self,
            [r.row for r in taken],
            limit,
            groups=mine,
            busy=self.busy + busy,
            parked=bool(changed),
        )
        self._open.add(batch)
        self.batches.append(batch)
        try:
            yield batch
        except BaseException:
            if not batch.committed:  # rolled back: what the claim itself changed, too
                for r, before in reversed(changed):
                    r.next_attempt = before
            raise
        finally:
            self._open.discard(batch)

    def _apply(self, outcome: BatchOutcome, claimed: Sequence[OutboxRow]) -> None:
        now = self.now
        for row_id in outcome.published:
            r = self.rows[row_id]
            r.published, r.published_at = True, now
        for row_id, error, delay in outcome.retry:
            r = self.rows[row_id]
            r.row = replace(r.row, attempts=r.row.attempts + 1)
            r.errors.append(error)
            r.next_attempt = now + delay
        for row_id, error in outcome.dead:
            r = self.rows[row_id]
            r.row = replace(r.row, attempts=r.row.attempts + 1)  # the dead letter's count
            r.dead = error
            r.dead_at = self.now
        # A retried row published, or any row dead-lettered, no longer holds its key's later
        # rows back: the key's next waiting row, if parked, is due now (promote_next).
        published, dead = set(outcome.published), {i for i, _ in outcome.dead}
        pending = self.pending()
        for c in claimed:
            if c.key is None or not (c.id in dead or (c.attempts and c.id in published)):
                continue
            nxt = next(
                (
                    w
                    for w in pending
                    if w.row.key == c.key and w.row.id > c.id and w.next_attempt is not None
                ),
                None,
            )
            if nxt is not None and nxt.next_attempt == PARKED:
                nxt.next_attempt = now

    async def has_due(self) -> bool:
        # Like the SQL's look, which takes no locks: any fresh row (rows that open claims hold
        # too; and held-back ones, which a claim parks), or a due row first of its key's
        # waiting rows.
        now = self.now
        pending = self.pending()
        first_waiting = self._first_waiting(pending)
        return any(
            r.next_attempt is None
            or (
                r.next_attempt <= now
                and (r.row.key is None or first_waiting[r.row.key] == r.row.id)
            )
            for r in pending
        )

    async def poll(self) -> tuple[bool, float | None]:
        # (PgOutboxStore's poll also promotes a parked row left first of its key by a row
        # deleted by hand or an older relay: nothing here leaves one.)
        now = self.now
        waits = [
            r.next_attempt - now
            for r in self.pending()
            if r.next_attempt is not None and r.waits(now)
        ]
        return await self.has_due(), min(waits) if waits else None

    async def count_pending(self, limit: int) -> int:
        return min(limit, len(self.pending()))

    async def delete_expired(self, older_than: float, limit: int) -> int:
        expired = [
            row_id
            for row_id, r in sorted(self.rows.items())
            if r.published_at is not None and r.published_at < self.now - older_than
        ][:limit]
        for row_id in expired:
            del self.rows[row_id]
        return len(expired)

    async def expire_dead_letters(self, older_than: float, limit: int) -> int:
        expired = [
            row_id
            for row_id, r in self.rows.items()
            if r.dead_at is not None and r.dead_at < self.now - older_than
        ]
        for row_id in expired:
            del self.rows[row_id]
        return len(expired)

    async def notify(self, channel: str, payload: str) -> None:
        self.notified.append((channel, payload))


class FakePublisher:
    """Records what it 'sent'. ``behaviour(row)`` returns None (deliver), ("fail", reason),
    ("reject", reason) or ("unavailable", reason)."""

    def __init__(self, behaviour: Callable[[OutboxRow], tuple[str, str] | None] | None = None):
        self.behaviour = behaviour or (lambda _row: None)
        self.sent: list[OutboxRow] = []
        self.gate: anyio.Event | None = None  # when set, publish waits for it
        self.entered = anyio.Event()
        self.available_calls = 0
        self.available = True
        self.answering = True  # False: Kafka went away (seen by check()); see back()
        self._back = anyio.Event()
        self.check_calls = 0
        #: The dependency an "unavailable" verdict names (PublishResult.dependency).
        self.dependency = "Kafka"

    async def publish(self, rows: Sequence[OutboxRow]) -> PublishResult:
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        result = PublishResult()
        blocked: set[str] = set()
        for row in rows:
            if row.key is not None and row.key in blocked:
                continue
            verdict = self.behaviour(row)
            if verdict is None:
                self.sent.append(row)
                result.delivered.append(row.id)
                continue
            kind, reason = verdict
            if kind == "unavailable":
                result.unavailable = reason
                result.dependency = self.dependency
                break
            (result.failed if kind == "fail" else result.rejected).append((row.id, reason))
            if row.key is not None:
                blocked.add(row.key)
        return result

    async def check(self) -> bool:
        self.check_calls += 1
        if not self.answering:
            self.available = False
        return self.available

    def back(self) -> None:
        """'Kafka' answers again."""
        self.answering = self.available = True
        self._back.set()

    async def wait_available(self) -> None:
        self.available_calls += 1
        if not self.available:
            await self._back.wait()


def fake_settings(**kw: object) -> OutboxSettings:
    """Settings for a relay on the fakes: poll-only, fast polls, retries without delay."""
    base: dict[str, object] = {
        "dsn": "postgresql://u:secret@127.0.0.1:1/db",
        "kafka_bootstrap_servers": "127.0.0.1:1",
        "poll_only": True,
        "poll_interval": 0.01,
        "retry_base_delay": 0.0,
        "retry_max_delay": 0.0,
    }
    base.update(kw)
    return OutboxSettings(**base)  # type: ignore[arg-type]
