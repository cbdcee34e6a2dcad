"""In-memory fakes of the relay's two ports, for fast unit tests of its logic. They are never
used by the integration tests, which talk to the real PostgreSQL and Kafka."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

import anyio

from notify_outbox import OutboxSettings
from notify_outbox.core.outbox import BatchOutcome, ClaimedBatch, OutboxRow
from notify_outbox.kafka.publisher import PublishResult


@dataclass
class FakeRow:
    row: OutboxRow
    published: bool = False
    dead: str | None = None
    next_attempt: float = 0.0
    errors: list[str] = field(default_factory=list)


class FakeBatch:
    def __init__(self, rows: list[OutboxRow]) -> None:
        self._rows = rows
        self.outcome: BatchOutcome | None = None
        self.keepalives = 0
        self.busy = 0
        self.parked = False

    @property
    def rows(self) -> Sequence[OutboxRow]:
        return self._rows

    @property
    def more_due(self) -> bool | None:
        return None  # unknown: the relay claims again to find out

    async def complete(self, outcome: BatchOutcome) -> None:
        self.outcome = outcome

    async def keepalive(self) -> None:
        self.keepalives += 1

    def idle(self) -> float:
        return 0.0


class FakeStore:
    """Claims like the SQL: per key, only the earliest pending row is a head; a worker that
    locks a head also takes the key's later rows. Outcomes apply only if the claim 'commits'."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.rows: dict[int, FakeRow] = {}
        self.locked: set[int] = set()
        self._next_id = 1
        self._clock = clock
        self._now = 0.0
        self.claims = 0
        #: The idle timeout each claim was given (the relay's ClaimIdleTimeout).
        self.idle_timeouts: list[float | None] = []
        self.batches: list[FakeBatch] = []
        #: Buckets held by other claims, as every claim reports them (ClaimedBatch.busy).
        self.busy = 0

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

    def pending(self) -> list[FakeRow]:
        return [r for _, r in sorted(self.rows.items()) if not r.published and r.dead is None]

    @asynccontextmanager
    async def claim(
        self, limit: int, idle_timeout: float | None = None
    ) -> AsyncIterator[ClaimedBatch]:
        self.claims += 1
        self.idle_timeouts.append(idle_timeout)
        pending = self.pending()
        first_of_key: dict[str, int] = {}
        for r in pending:
            if r.row.key is not None:
                first_of_key.setdefault(r.row.key, r.row.id)
        heads = [
            r
            for r in pending
            if r.row.id not in self.locked
            and r.next_attempt <= self.now
            and (r.row.key is None or first_of_key[r.row.key] == r.row.id)
        ][:limit]
        keys = {r.row.key for r in heads if r.row.key is not None}
        head_ids = {r.row.id for r in heads}
        followers = [r for r in pending if r.row.key in keys and r.row.id not in head_ids][:limit]
        claimed = sorted(heads + followers, key=lambda r: r.row.id)
        ids = {r.row.id for r in claimed}
        self.locked |= ids
        batch = FakeBatch([r.row for r in claimed])
        batch.busy = self.busy
        self.batches.append(batch)
        try:
            yield batch
            if batch.outcome is not None:  # the claim "commits"
                self._apply(batch.outcome)
        finally:
            self.locked -= ids

    def _apply(self, outcome: BatchOutcome) -> None:
        for row_id in outcome.published:
            self.rows[row_id].published = True
        for row_id, error, delay in outcome.retry:
            r = self.rows[row_id]
            r.row = replace(r.row, attempts=r.row.attempts + 1)
            r.errors.append(error)
            r.next_attempt = self.now + delay
        for row_id, error in outcome.dead:
            self.rows[row_id].dead = error

    async def has_due(self) -> bool:
        # Like the SQL: a row counts only if a claim could take it, i.e. it is due and no
        # earlier row of its key is pending.
        seen: set[str] = set()
        for r in self.pending():
            if r.row.key is None or r.row.key not in seen:
                if r.next_attempt <= self.now and r.row.id not in self.locked:
                    return True
                if r.row.key is not None:
                    seen.add(r.row.key)
        return False

    async def poll(self) -> tuple[bool, float | None]:
        waits = [r.next_attempt - self.now for r in self.pending() if r.next_attempt > self.now]
        return await self.has_due(), min(waits) if waits else None

    async def count_pending(self, limit: int) -> int:
        return min(limit, len(self.pending()))

    async def delete_expired(self, older_than: float, limit: int) -> int:
        return 0


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
