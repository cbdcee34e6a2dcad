"""The invariant checker of the fault suite (docs: reliability.md, I1-I4).

Producers record what they did, and the database records what committed:

* every producing transaction inserts its outbox row, *then* bumps a per-key counter row
  (``fault_key_counter``; its row lock is held until commit, so per key the counter values
  follow commit order, independently of the outbox ids), and writes ``(event_id, key, seq)``
  into ``fault_commits`` in the same transaction. ``fault_commits`` is therefore the ground
  truth of what committed, even for commits whose outcome the client never learnt (a
  PostgreSQL restart during COMMIT);
* where the producing role may, the counter value is also stamped into the row's payload, so
  the consumer can check that what arrived is what was written;
* an in-memory ``Ledger`` keeps what each producer attempted and believes happened (committed,
  rolled back, failed, uncertain), to explain phantoms and to cross-check the ground truth.

``OutboxChecker.drain_and_check`` waits until the outbox has no pending row, reads the topics
from the beginning to the high watermarks seen at that moment, and reports lost / phantom /
duplicated / out-of-order events. Per key, order is judged on the first occurrence of each
``outbox-event-id``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition

from tests.faults.harness import connect as _connect
from tests.faults.harness import partitions
from tests.support import header

SETUP_SQL = """
CREATE TABLE IF NOT EXISTS fault_key_counter (key text PRIMARY KEY, n integer NOT NULL);
CREATE TABLE IF NOT EXISTS fault_commits (
    event_id uuid PRIMARY KEY,
    topic    text NOT NULL,
    key      text,
    seq      integer,
    committed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""

# Insert first (the outbox trigger takes the key's advisory lock and draws the id), then bump
# the counter: if the trigger did not serialize same-key writers, ids and counter values could
# disagree and the order check would catch it.
INSERT_RETURNING = (
    "INSERT INTO outbox (event_id, topic, key, payload) "
    "VALUES ($1::uuid, $2, $3, jsonb_build_object('eid', $1::uuid::text)) RETURNING id"
)
_INSERT = (
    "INSERT INTO outbox (event_id, topic, key, payload) "
    "VALUES ($1::uuid, $2, $3, jsonb_build_object('eid', $1::uuid::text))"
)
_RECORD_KEYED = """
WITH bumped AS (
    INSERT INTO fault_key_counter AS c (key, n) VALUES ($3, 1)
    ON CONFLICT (key) DO UPDATE SET n = c.n + 1
    RETURNING n
)
INSERT INTO fault_commits (event_id, topic, key, seq)
SELECT $1, $2, $3, n FROM bumped
RETURNING seq
"""
RECORD_AND_STAMP = """
WITH bumped AS (
    INSERT INTO fault_key_counter AS c (key, n) VALUES ($3, 1)
    ON CONFLICT (key) DO UPDATE SET n = c.n + 1
    RETURNING n
), rec AS (
    INSERT INTO fault_commits (event_id, topic, key, seq)
    SELECT $1, $2, $3, n FROM bumped
    RETURNING event_id, seq
)
UPDATE outbox SET payload = jsonb_build_object('eid', rec.event_id, 'seq', rec.seq)
FROM rec WHERE outbox.id = $4
RETURNING rec.seq
"""
_RECORD_KEYLESS = (
    "INSERT INTO fault_commits (event_id, topic, key, seq) VALUES ($1, $2, NULL, NULL)"
)
# Many events in one transaction: one INSERT (its NOTIFYs fold into one), rows in the given
# order, which is the commit order within the transaction.
_BULK_INSERT = """
INSERT INTO outbox (event_id, topic, key, payload)
SELECT e, $3, k, jsonb_build_object('eid', e::text, 'bulk', o)
FROM unnest($1::uuid[], $2::text[]) WITH ORDINALITY AS u(e, k, o)
ORDER BY o
"""
_BULK_RECORD = """
WITH u AS (
    SELECT e, k, o FROM unnest($1::uuid[], $2::text[]) WITH ORDINALITY AS u(e, k, o)
), counts AS (
    SELECT k, count(*)::int AS c FROM u WHERE k IS NOT NULL GROUP BY k
), bumped AS (
    INSERT INTO fault_key_counter AS kc (key, n)
    SELECT k, c FROM counts ORDER BY k
    ON CONFLICT (key) DO UPDATE SET n = kc.n + EXCLUDED.n
    RETURNING key, n
)
INSERT INTO fault_commits (event_id, topic, key, seq)
SELECT u.e, $3, u.k,
       CASE WHEN u.k IS NULL THEN NULL
            ELSE b.n - c.c + row_number() OVER (PARTITION BY u.k ORDER BY u.o) END
FROM u LEFT JOIN bumped AS b ON b.key = u.k LEFT JOIN counts AS c ON c.k = u.k
"""


# What a restart, a terminated backend or a deadlock looks like to a writer; anything else
# (a bad statement) is a bug in the test and must surface.
TRANSIENT_DB_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.OperatorInterventionError,
    asyncpg.TransactionRollbackError,
    # asyncpg's protocol state after the server vanished mid-statement.
    asyncpg.InternalClientError,
)


# --- what producers did -----------------------------------------------------------------------


@dataclass
class Attempt:
    topic: str
    key: str | None
    # "committed", "rolled_back", "failed" (error before COMMIT), or "uncertain" (COMMIT sent,
    # no answer): the last two are settled by fault_commits.
    outcome: str = "failed"


@dataclass
class Ledger:
    attempts: dict[str, Attempt] = field(default_factory=dict)
    commit_latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    def ids(self, outcome: str) -> set[str]:
        return {e for e, a in self.attempts.items() if a.outcome == outcome}

    def count(self, outcome: str) -> int:
        return sum(1 for a in self.attempts.values() if a.outcome == outcome)


class Producer:
    """One application connection writing events the checker can account for.

    ``stamp=False`` is for a role with INSERT only on the outbox (no RETURNING, no UPDATE):
    the commit order then lives in ``fault_commits`` alone.
    """

    def __init__(self, dsn: str, topic: str, ledger: Ledger, *, stamp: bool = True) -> None:
        self.dsn = dsn
        self.topic = topic
        self.ledger = ledger
        self.stamp = stamp
        self.conn: asyncpg.Connection | None = None

    async def __aenter__(self) -> Producer:
        self.conn = await asyncpg.connect(self.dsn)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close()
            self.conn = None

    async def begin(
        self,
        key: str | None,
        *,
        doomed_savepoint: bool = False,
        topic: str | None = None,
        payload: str | None = None,
        headers: str | None = None,
    ) -> OpenEvent:
        """Insert one event in a new transaction and leave it open (commit or roll back the
        returned handle). ``doomed_savepoint`` first inserts another event inside a savepoint
        that is rolled back, while the transaction goes on. ``topic``, ``payload`` and
        ``headers`` (JSON text) make a custom row, such as a poison one (never stamped)."""
        assert self.conn is not None
        conn = self.conn
        topic = topic or self.topic
        tx = conn.transaction()
        await tx.start()
        try:
            if doomed_savepoint:
                doomed = str(uuid.uuid4())
                self.ledger.attempts[doomed] = Attempt(topic, key, "rolled_back")
                savepoint = conn.transaction()
                await savepoint.start()
                await self._insert(conn, doomed, key, topic, None, None)
                await savepoint.rollback()
            event_id = str(uuid.uuid4())
            attempt = self.ledger.attempts[event_id] = Attempt(topic, key)
            await self._insert(conn, event_id, key, topic, payload, headers)
        except BaseException:
            with contextlib.suppress(Exception):
                await tx.rollback()
            raise
        return OpenEvent(event_id, tx, [attempt], self.ledger)

    async def _insert(
        self,
        conn: asyncpg.Connection,
        event_id: str,
        key: str | None,
        topic: str | None = None,
        payload: str | None = None,
        headers: str | None = None,
    ) -> None:
        topic = topic or self.topic
        if payload is not None or headers is not None:
            await conn.execute(
                "INSERT INTO outbox (event_id, topic, key, payload, headers) "
                "VALUES ($1, $2, $3, $4::jsonb, $5::jsonb)",
                event_id,
                topic,
                key,
                payload,
                headers,
            )
            await self._record(conn, event_id, key, topic)
        elif self.stamp and key is not None:
            row_id = await conn.fetchval(INSERT_RETURNING, event_id, topic, key)
            await conn.fetchval(RECORD_AND_STAMP, event_id, topic, key, row_id)
        else:
            await conn.execute(_INSERT, event_id, topic, key)
            await self._record(conn, event_id, key, topic)

    @staticmethod
    async def _record(conn: asyncpg.Connection, event_id: str, key: str | None, topic: str) -> None:
        if key is None:
            await conn.execute(_RECORD_KEYLESS, event_id, topic)
        else:
            await conn.execute(_RECORD_KEYED, event_id, topic, key)

    async def produce(
        self,
        key: str | None,
        *,
        rollback: bool = False,
        doomed_savepoint: bool = False,
        topic: str | None = None,
        payload: str | None = None,
        headers: str | None = None,
    ) -> str:
        """One event in its own transaction; returns its event id. Raises what the database
        raised (the ledger knows whether COMMIT was reached). See ``begin`` for the rest."""
        event = await self.begin(
            key, doomed_savepoint=doomed_savepoint, topic=topic, payload=payload, headers=headers
        )
        if rollback:
            await event.rollback()
        else:
            await event.commit()
        return event.event_id

    async def prepare(self, key: str | None, gid: str) -> PreparedEvent:
        """Insert one event in a new transaction and ``PREPARE TRANSACTION`` it (two-phase
        commit): the session is free again, the transaction lives on in the server until
        ``COMMIT PREPARED`` or ``ROLLBACK PREPARED`` (the returned handle, from any session).
        Its transaction id and row id are read before the PREPARE."""
        assert self.conn is not None
        conn = self.conn
        event_id = str(uuid.uuid4())
        attempt = self.ledger.attempts[event_id] = Attempt(self.topic, key)
        await conn.execute("BEGIN")
        try:
            await self._insert(conn, event_id, key)
            row_id, xid = await conn.fetchrow(
                "SELECT id, pg_current_xact_id()::text::bigint FROM outbox WHERE event_id = $1",
                event_id,
            )
            # Its fate is settled by the second phase; until then a check must not run.
            attempt.outcome = "uncertain"
            await conn.execute(f"PREPARE TRANSACTION '{gid}'")
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.execute("ROLLBACK")
            attempt.outcome = "failed"
            raise
        return PreparedEvent(event_id, gid, int(row_id), int(xid), attempt)

    async def many(self, keys: Sequence[str | None]) -> list[str]:
        """Many events in one transaction, one INSERT statement each (their identical
        NOTIFYs fold into one at commit)."""
        assert self.conn is not None
        conn = self.conn
        ids = [str(uuid.uuid4()) for _ in keys]
        attempts = []
        tx = conn.transaction()
        await tx.start()
        try:
            for event_id, key in zip(ids, keys, strict=True):
                attempts.append(Attempt(self.topic, key))
                self.ledger.attempts[event_id] = attempts[-1]
                await self._insert(conn, event_id, key)
        except BaseException:
            with contextlib.suppress(Exception):
                await tx.rollback()
            raise
        await OpenEvent(ids[0], tx, attempts, self.ledger).commit()
        return ids

    async def bulk(self, keys: Sequence[str | None], *, rollback: bool = False) -> list[str]:
        """Many events in one transaction and one INSERT; returns their event ids."""
        assert self.conn is not None
        conn = self.conn
        ids = [str(uuid.uuid4()) for _ in keys]
        attempts = []
        for event_id, key in zip(ids, keys, strict=True):
            attempts.append(Attempt(self.topic, key))
            self.ledger.attempts[event_id] = attempts[-1]
        tx = conn.transaction()
        await tx.start()
        try:
            await conn.execute(_BULK_INSERT, ids, list(keys), self.topic)
            await conn.execute(_BULK_RECORD, ids, list(keys), self.topic)
            if rollback:
                await tx.rollback()
                for a in attempts:
                    a.outcome = "rolled_back"
                return ids
        except BaseException:
            with contextlib.suppress(Exception):
                await tx.rollback()
            raise
        await OpenEvent(ids[0], tx, attempts, self.ledger).commit()
        return ids


@dataclass
class OpenEvent:
    """An event inserted in a transaction that is still open."""

    event_id: str
    tx: Any
    attempts: list[Attempt]
    ledger: Ledger

    async def commit(self) -> None:
        for a in self.attempts:
            a.outcome = "uncertain"
        started = time.monotonic()
        await self.tx.commit()
        self.ledger.commit_latencies.append(time.monotonic() - started)
        for a in self.attempts:
            a.outcome = "committed"

    async def rollback(self) -> None:
        await self.tx.rollback()
        for a in self.attempts:
            a.outcome = "rolled_back"


@dataclass
class PreparedEvent:
    """An event of a PREPAREd transaction (``Producer.prepare``)."""

    event_id: str
    gid: str
    row_id: int
    xid: int  # the transaction's full id (xid8), as the relay's low-water mark lists it
    attempt: Attempt

    async def commit(self, conn: asyncpg.Connection) -> None:
        await conn.execute(f"COMMIT PREPARED '{self.gid}'")
        self.attempt.outcome = "committed"

    async def rollback(self, conn: asyncpg.Connection) -> None:
        await conn.execute(f"ROLLBACK PREPARED '{self.gid}'")
        self.attempt.outcome = "rolled_back"


@dataclass
class WriterLoad:
    """Concurrent writers: single-event transactions over ``keys`` keys, some rolled back,
    reconnecting after errors (a PostgreSQL restart), until ``stop`` is set."""

    dsn: str
    topic: str
    ledger: Ledger
    writers: int = 4
    keys: int = 20
    rollback_ratio: float = 0.1
    savepoint_ratio: float = 0.05  # a rolled-back savepoint inside a committed transaction
    keyless_ratio: float = 0.0
    pause: float = 0.005  # load shaping between transactions, not synchronisation
    seed: int = 0
    stamp: bool = True
    max_events: int | None = None  # per writer
    # A second topic, and the share of events sent there: a key's rows then go to both topics
    # (the checker's order across topics).
    other_topic: str | None = None
    other_topic_ratio: float = 0.5
    stop: anyio.Event = field(default_factory=anyio.Event)
    finished: anyio.Event = field(default_factory=anyio.Event)
    produced: int = 0

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                for w in range(self.writers):
                    tg.start_soon(self._writer, w)
        finally:
            self.finished.set()

    async def halt(self, within: float = 30.0) -> None:
        """Stop the writers and wait until their last transactions have ended (the check
        must not start while one could still commit)."""
        self.stop.set()
        with anyio.fail_after(within):
            await self.finished.wait()

    async def _writer(self, w: int) -> None:
        rng = random.Random(self.seed * 1000 + w)
        done = 0
        delay = 0.05
        while not self.stop.is_set() and (self.max_events is None or done < self.max_events):
            try:
                async with Producer(self.dsn, self.topic, self.ledger, stamp=self.stamp) as p:
                    delay = 0.05
                    while not self.stop.is_set() and (
                        self.max_events is None or done < self.max_events
                    ):
                        key = None
                        if rng.random() >= self.keyless_ratio:
                            key = f"key-{rng.randrange(self.keys)}"
                        topic = None  # the load's topic
                        # Drawn only with a second topic: other loads keep their sequences.
                        if self.other_topic is not None and rng.random() < self.other_topic_ratio:
                            topic = self.other_topic
                        await p.produce(
                            key,
                            rollback=rng.random() < self.rollback_ratio,
                            doomed_savepoint=rng.random() < self.savepoint_ratio,
                            topic=topic,
                        )
                        done += 1
                        self.produced += 1
                        if self.pause:
                            await anyio.sleep(self.pause * rng.uniform(0.5, 1.5))
            except TRANSIENT_DB_ERRORS as e:
                # A restart or a terminated connection: count it, reconnect with a short
                # bounded backoff.
                self.ledger.errors[f"{type(e).__name__}: {str(e)[:60]}"] += 1
                with anyio.move_on_after(delay):
                    await self.stop.wait()
                delay = min(delay * 2, 0.5)


# --- figures of the whole run (tests/faults/last_run.json) -----------------------------------


@dataclass
class RunFigures:
    checks: list[dict[str, Any]] = field(default_factory=list)
    recoveries: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    notes: dict[str, Any] = field(default_factory=dict)

    def recovery(self, kind: str, seconds: float) -> None:
        self.recoveries[kind].append(round(seconds, 3))

    def summary(self) -> dict[str, Any]:
        dup_after: Counter[str] = Counter()
        for c in self.checks:
            for reason, n in c["duplicates_by_fault"].items():
                dup_after[reason] += n
        return {
            "scenarios_checked": len(self.checks),
            "events_checked": sum(c["committed_checked"] for c in self.checks),
            "lost": sum(c["lost"] for c in self.checks),
            "phantom": sum(c["phantom"] for c in self.checks),
            "duplicates": sum(c["duplicates"] for c in self.checks),
            "duplicates_by_fault": dict(dup_after),
            "order_violations": sum(c["order_violations"] for c in self.checks),
            "failed_checks": [c["scenario"] for c in self.checks if not c["ok"]],
            "longest_recovery_s": {k: max(v) for k, v in sorted(self.recoveries.items())},
            "recoveries_s": dict(sorted(self.recoveries.items())),
            "checks": self.checks,
            "notes": self.notes,
        }


FIGURES = RunFigures()


# --- the check --------------------------------------------------------------------------------


@dataclass
class Seen:
    topic: str
    partition: int
    offset: int
    key: str | None
    event_id: str | None
    payload: Any
    timestamp_ms: int


@dataclass
class CheckReport:
    scenario: str
    committed: int = 0
    expected_live: int = 0
    ledger_counts: dict[str, int] = field(default_factory=dict)
    writer_errors: dict[str, int] = field(default_factory=dict)
    dead_lettered: set[str] = field(default_factory=set)
    expected_dead: set[str] | None = None
    messages: int = 0
    distinct: int = 0
    lost: list[str] = field(default_factory=list)
    phantom: list[str] = field(default_factory=list)
    rolled_back_seen: list[str] = field(default_factory=list)
    no_event_id: int = 0
    duplicate_ids: dict[str, int] = field(default_factory=dict)  # event id -> extra copies
    allowed_duplicates: int = 0
    allowances: list[tuple[str, int]] = field(default_factory=list)
    allowed_ids: set[str] | None = None
    keys: int = 0
    out_of_order: dict[str, list[int]] = field(default_factory=dict)  # (topic/key) -> seqs
    inversions: int = 0
    keys_across_topics: int = 0  # keys with rows on more than one topic (order checked too)
    mismatched: list[str] = field(default_factory=list)
    ledger_problems: list[str] = field(default_factory=list)
    drained: bool = False
    pending_left: int = 0
    seconds: float = 0.0
    records: list[Seen] = field(default_factory=list)
    # read_committed checks only: where the consumer stopped short of a partition's high
    # watermark (an open transaction), and where the lost events are in the log, if at all.
    stuck: list[str] = field(default_factory=list)
    lost_in_log: str = ""

    @property
    def duplicates(self) -> int:
        return sum(self.duplicate_ids.values())

    @property
    def unexpected_dead(self) -> set[str]:
        return self.dead_lettered - (self.expected_dead or set())

    @property
    def missing_dead(self) -> set[str]:
        return (self.expected_dead or set()) - self.dead_lettered

    @property
    def duplicates_ok(self) -> bool:
        if self.duplicates > self.allowed_duplicates:
            return False
        return self.allowed_ids is None or set(self.duplicate_ids) <= self.allowed_ids

    @property
    def ok(self) -> bool:
        return (
            self.drained
            and not self.lost
            and not self.phantom
            and not self.no_event_id
            and self.duplicates_ok
            and not self.out_of_order
            and not self.mismatched
            and not self.ledger_problems
            and not self.unexpected_dead
            and not self.missing_dead
        )

    def text(self) -> str:
        def some(items: Iterable[Any], n: int = 8) -> str:
            items = list(items)
            more = f" ... (+{len(items) - n})" if len(items) > n else ""
            return ", ".join(map(str, items[:n])) + more

        lc = self.ledger_counts
        allow = "; ".join(f"{r}: {n}" for r, n in self.allowances) or "none"
        lines = [
            f"invariant check [{self.scenario}] {'OK' if self.ok else 'FAILED'}",
            f"  committed {self.committed} (ledger: committed {lc.get('committed', 0)}, rolled "
            f"back {lc.get('rolled_back', 0)}, failed before commit {lc.get('failed', 0)}, "
            f"uncertain {lc.get('uncertain', 0)}; writer errors {self.writer_errors or 0}); "
            f"dead-lettered {len(self.dead_lettered)} "
            f"(expected {len(self.expected_dead or ())}); expected in Kafka {self.expected_live}",
            f"  kafka: {self.messages} messages, {self.distinct} distinct event ids; drained: "
            f"{self.drained} (pending rows left {self.pending_left}) after {self.seconds:.1f}s",
            f"  I1 lost: {len(self.lost)}" + (f" [{some(self.lost)}]" if self.lost else ""),
            f"  I2 phantom: {len(self.phantom)} (of which rolled back: "
            f"{len(self.rolled_back_seen)}); messages without outbox-event-id: "
            f"{self.no_event_id}" + (f" [{some(self.phantom)}]" if self.phantom else ""),
            f"  I3 duplicates: {self.duplicates} extra copies of {len(self.duplicate_ids)} "
            f"events; allowed {self.allowed_duplicates} ({allow})"
            + ("" if self.duplicates_ok else "  <-- over the bound or not in flight"),
            f"  I4 order: {len(self.out_of_order)} of {self.keys} keys out of commit order, "
            f"{self.inversions} adjacent inversions ({self.keys_across_topics} keys on several "
            f"topics, checked across them by send time; shown as */key)",
        ]
        for key, seqs in list(self.out_of_order.items())[:5]:
            lines.append(f"     {key}: seqs as consumed {some(seqs, 30)}")
        if self.mismatched:
            lines.append(
                f"  payload/key mismatches: {len(self.mismatched)} [{some(self.mismatched)}]"
            )
        if self.unexpected_dead or self.missing_dead:
            lines.append(
                f"  dead letters: unexpected {some(self.unexpected_dead)}; "
                f"missing {some(self.missing_dead)}"
            )
        if self.ledger_problems:
            lines.append(f"  ledger vs database: {some(self.ledger_problems)}")
        if self.stuck:
            lines.append(f"  read_committed stopped short of the end: {some(self.stuck)}")
        if self.lost_in_log:
            lines.append(f"  the lost events in the log (read_uncommitted): {self.lost_in_log}")
        return "\n".join(lines)

    def figures(self) -> dict[str, Any]:
        by_fault: Counter[str] = Counter()
        left = self.duplicates
        for reason, n in self.allowances:
            take = min(left, n)
            if take:
                by_fault[reason.split(":")[0]] += take
            left -= take
        if left > 0:
            by_fault["unexplained"] += left
        return {
            "scenario": self.scenario,
            "ok": self.ok,
            "committed_checked": self.committed,
            "messages": self.messages,
            "lost": len(self.lost),
            "phantom": len(self.phantom) + self.no_event_id,
            "duplicates": self.duplicates,
            "allowed_duplicates": self.allowed_duplicates,
            "duplicates_by_fault": dict(by_fault),
            "order_violations": self.inversions,
            "keys_out_of_order": len(self.out_of_order),
            "dead_lettered": len(self.dead_lettered),
            "seconds_to_drain": round(self.seconds, 2),
        }

    def assert_ok(self) -> None:
        assert self.ok, self.text()


class OutboxChecker:
    """Checks I1-I4 for one test database and its topics."""

    def __init__(
        self,
        dsn: str,
        bootstrap: str,
        topics: Sequence[str],
        scenario: str,
        *,
        isolation_level: str = "read_uncommitted",
    ) -> None:
        """``isolation_level``: how the check reads the topics (``read_committed`` for the
        exactly-once mode: what its consumers see)."""
        self.dsn = dsn
        self.isolation_level = isolation_level
        self.bootstrap = bootstrap
        self.topics = list(topics)
        self.scenario = scenario
        self.ledger = Ledger()
        self._allowances: list[tuple[str, int]] = []
        self._allowed_ids: set[str] | None = None
        self._expected_dead: set[str] = set()
        self._writer_errors_expected = False

    async def setup(self) -> OutboxChecker:
        conn = await asyncpg.connect(self.dsn)
        try:
            await conn.execute(SETUP_SQL)
        finally:
            await conn.close()
        return self

    def producer(
        self, *, dsn: str | None = None, topic: str | None = None, stamp: bool = True
    ) -> Producer:
        return Producer(dsn or self.dsn, topic or self.topics[0], self.ledger, stamp=stamp)

    def writers(self, **kw: Any) -> WriterLoad:
        kw.setdefault("topic", self.topics[0])
        kw.setdefault("dsn", self.dsn)
        return WriterLoad(ledger=self.ledger, **kw)

    async def dead_letters(self) -> dict[str, asyncpg.Record]:
        """The dead-letter table by event id."""
        async with _connect(self.dsn) as conn:
            rows = await conn.fetch("SELECT *, event_id::text AS eid FROM outbox_dead_letter")
        return {r["eid"]: r for r in rows}

    def allow_duplicates(self, count: int, reason: str) -> None:
        """Allow up to ``count`` more duplicate copies: the rows in flight at a fault."""
        self._allowances.append((reason, count))

    def allow_duplicate_ids(self, ids: Iterable[str], reason: str) -> None:
        """Allow duplicates of exactly these events (one extra copy each), and of no other."""
        ids = set(ids)
        self._allowed_ids = (self._allowed_ids or set()) | ids
        self._allowances.append((reason, len(ids)))

    def expect_writer_errors(self) -> None:
        """The scenario breaks the writers' connections (a PostgreSQL restart): their errors
        are expected. Otherwise any writer error fails the check (it would hide a bug)."""
        self._writer_errors_expected = True

    def expect_dead(self, ids: Iterable[str]) -> None:
        self._expected_dead |= set(ids)

    async def drain_and_check(self, *, within: float = 120.0, record: bool = True) -> CheckReport:
        """Wait for the backlog to drain, read everything, compare, record the figures."""
        started = time.monotonic()
        report = CheckReport(self.scenario)
        report.allowances = list(self._allowances)
        report.allowed_duplicates = sum(n for _, n in self._allowances)
        report.allowed_ids = self._allowed_ids
        report.expected_dead = set(self._expected_dead)
        report.ledger_counts = {
            o: self.ledger.count(o) for o in ("committed", "rolled_back", "failed", "uncertain")
        }
        report.writer_errors = dict(self.ledger.errors)
        conn = await asyncpg.connect(self.dsn)
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level=self.isolation_level,
        )
        await consumer.start()
        try:
            tps = await partitions(consumer, self.topics)
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            records: list[Seen] = []
            ends: dict[TopicPartition, int] = {}

            async def read(ms: int) -> None:
                for batch in (await consumer.getmany(*tps, timeout_ms=ms)).values():
                    for r in batch:
                        records.append(_seen(r))

            # The outbox is drained when no row is pending; everything marked was acked by
            # Kafka before, so the end offsets read *after* that moment cover it all. They are
            # the high watermarks (a read_uncommitted client's): a read_committed consumer's
            # end_offsets is the last stable offset, which can still stand below a transaction
            # the relay saw committed (the coordinator writes its markers after it answered
            # the commit) or below one left open; reading only up to it would call the rows
            # behind it lost. A read_committed consumer passes the high watermark once every
            # transaction below it has ended.
            with anyio.move_on_after(within):
                while True:
                    await read(100)
                    report.pending_left = await conn.fetchval(
                        "SELECT count(*) FROM outbox WHERE published_at IS NULL"
                    )
                    if report.pending_left == 0:
                        break
                ends = await high_watermarks(self.bootstrap, tps)

                async def behind() -> bool:
                    for tp, end in ends.items():
                        if await consumer.position(tp) < end:
                            return True
                    return False

                while await behind():
                    await read(100)
                report.drained = True
            if not report.drained and self.isolation_level == "read_committed":
                stable = await consumer.end_offsets(tps)
                for tp in tps:
                    position = await consumer.position(tp)
                    if position < ends.get(tp, 0):
                        report.stuck.append(
                            f"{tp.topic}[{tp.partition}] at {position}, last stable offset "
                            f"{stable[tp]}, high watermark {ends[tp]}"
                        )
            committed = {
                str(r["event_id"]): r
                for r in await conn.fetch(
                    "SELECT event_id, topic, key, seq FROM fault_commits WHERE topic = ANY($1)",
                    self.topics,
                )
            }
            report.dead_lettered = {
                str(r["event_id"])
                for r in await conn.fetch("SELECT event_id FROM outbox_dead_letter")
            }
        finally:
            await consumer.stop()
            await conn.close()
        report.seconds = time.monotonic() - started
        report.records = records
        self._compare(report, committed, records)
        if report.lost and self.isolation_level == "read_committed":
            report.lost_in_log = await self._find_in_log(tps, set(report.lost))
        if record:
            FIGURES.checks.append(report.figures())
        return report

    async def _find_in_log(self, tps: list[TopicPartition], lost: set[str]) -> str:
        """Where events a read_committed check did not see are in the log: in a
        transaction that was aborted or is still open, or nowhere (never written)."""
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_uncommitted",
        )
        await consumer.start()
        found: dict[str, Seen] = {}
        try:
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends = await consumer.end_offsets(tps)
            with anyio.move_on_after(30):
                while any([await consumer.position(tp) < end for tp, end in ends.items()]):
                    for batch in (await consumer.getmany(*tps, timeout_ms=200)).values():
                        for r in batch:
                            seen = _seen(r)
                            if seen.event_id in lost and seen.event_id not in found:
                                found[seen.event_id] = seen
        finally:
            await consumer.stop()
        places = Counter(f"{s.topic}[{s.partition}]" for s in found.values())
        offsets = sorted((s.partition, s.offset) for s in found.values())
        span = (
            f", from partition {offsets[0][0]} offset {offsets[0][1]} to partition "
            f"{offsets[-1][0]} offset {offsets[-1][1]}"
            if offsets
            else ""
        )
        return (
            f"{len(found)} of {len(lost)} written (not committed: aborted or still open) "
            f"{dict(places)}{span}; {len(lost) - len(found)} never written"
        )

    def _compare(
        self, report: CheckReport, committed: dict[str, asyncpg.Record], records: list[Seen]
    ) -> None:
        report.committed = len(committed)
        live = set(committed) - report.dead_lettered
        report.expected_live = len(live)
        report.messages = len(records)
        copies = Counter(r.event_id for r in records if r.event_id is not None)
        report.no_event_id = sum(1 for r in records if r.event_id is None)
        report.distinct = len(copies)
        report.lost = sorted(live - copies.keys())
        report.phantom = sorted(copies.keys() - committed.keys())
        report.rolled_back_seen = sorted(set(report.phantom) & self.ledger.ids("rolled_back"))
        report.duplicate_ids = {e: n - 1 for e, n in copies.items() if n > 1}

        if report.writer_errors and not self._writer_errors_expected:
            report.ledger_problems.append(f"unexpected writer errors {report.writer_errors}")
        # Ledger against ground truth: what a producer saw commit must be in fault_commits,
        # what it rolled back (or failed before COMMIT) must not.
        for event_id, a in self.ledger.attempts.items():
            if a.topic not in self.topics:
                continue
            if a.outcome == "committed" and event_id not in committed:
                report.ledger_problems.append(f"{event_id} committed but not recorded")
            if a.outcome in ("rolled_back", "failed") and event_id in committed:
                report.ledger_problems.append(f"{event_id} {a.outcome} but recorded")

        # Per (topic, key): first occurrences in offset order must have increasing seqs.
        first: dict[str, Seen] = {}
        for r in sorted(records, key=lambda r: (r.topic, r.partition, r.offset)):
            if r.event_id is not None and r.event_id not in first:
                first[r.event_id] = r
        per_key: dict[str, list[int]] = defaultdict(list)
        across: dict[str, list[tuple[int, Seen]]] = defaultdict(list)
        for r in sorted(first.values(), key=lambda r: (r.topic, r.partition, r.offset)):
            row = committed.get(r.event_id or "")
            if row is None:
                continue
            if r.key != row["key"]:
                report.mismatched.append(f"{r.event_id}: key {r.key!r} != {row['key']!r}")
            stamped = r.payload.get("seq") if isinstance(r.payload, dict) else None
            if stamped is not None and stamped != row["seq"]:
                report.mismatched.append(f"{r.event_id}: payload seq {stamped} != {row['seq']}")
            if row["key"] is not None:
                per_key[f"{r.topic}/{row['key']}"].append(row["seq"])
                across[row["key"]].append((row["seq"], r))
        report.keys = len(per_key)
        for key, seqs in per_key.items():
            bad = sum(1 for a, b in itertools.pairwise(seqs) if b <= a)
            if bad:
                report.inversions += bad
                report.out_of_order[key] = seqs
        # Across topics (different partitions: no offset order between them). The promise
        # (docs/concepts/guarantees.md): a key's row for another topic is sent only after the
        # key's row before it was acknowledged. So, in commit order, no row's first copy may
        # carry an earlier CreateTime (stamped by the relay's producer at send, in ms) than
        # the key's row before it on another topic. A tie within one millisecond passes.
        for key, rows in across.items():
            if len({r.topic for _, r in rows}) < 2:
                continue
            report.keys_across_topics += 1
            rows.sort(key=lambda sr: sr[0])
            bad = sum(
                1
                for (_, a), (_, b) in itertools.pairwise(rows)
                if a.topic != b.topic and b.timestamp_ms < a.timestamp_ms
            )
            if bad:
                report.inversions += bad
                report.out_of_order[f"*/{key}"] = [seq for seq, _ in rows]


async def high_watermarks(bootstrap: str, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
    """Each partition's high watermark: the end offsets a read_uncommitted client sees."""
    probe = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_uncommitted")
    await probe.start()
    try:
        return dict(await probe.end_offsets(tps))
    finally:
        await probe.stop()


def _seen(record: Any) -> Seen:
    try:
        payload = json.loads(record.value) if record.value is not None else None
    except ValueError:
        payload = None
    return Seen(
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key.decode() if record.key is not None else None,
        event_id=header(record, "outbox-event-id"),
        payload=payload,
        timestamp_ms=record.timestamp,
    )
