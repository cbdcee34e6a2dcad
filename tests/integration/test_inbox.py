"""The consumer-side inbox against a real PostgreSQL (and Kafka for ``consume``): its migration
track, ``process`` semantics, concurrency, bad input, retention and the Kafka loop."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta

import anyio
import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from notify_outbox import ConfigurationError, OutboxNames, migrate, verify
from notify_outbox.inbox import (
    BadEventId,
    Inbox,
    InboxNames,
    InboxNotMigrated,
    NotInTransaction,
    consume,
    migrate_inbox,
    purge_inbox,
    render_inbox_migrations,
    verify_inbox,
)
from tests.conftest import Services
from tests.support import ROOT

pytestmark = pytest.mark.anyio

BUSINESS = "CREATE TABLE applied (event_id text NOT NULL, note text)"


@dataclass
class Msg:
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    key: bytes | None = None


def event(eid: uuid.UUID | str | None = None) -> Msg:
    return Msg([("outbox-event-id", str(eid or uuid.uuid4()).encode())])


@contextlib.asynccontextmanager
async def connect(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(dsn)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def inbox_db(empty_db_dsn: str) -> str:
    """A consumer's database: the inbox migrated, and a business table ``applied``."""
    async with connect(empty_db_dsn) as conn:
        await migrate_inbox(conn)
        await conn.execute(BUSINESS)
    return empty_db_dsn


async def apply_once(conn: asyncpg.Connection, inbox: Inbox, msg: Msg, note: str = "") -> bool:
    async with conn.transaction(), inbox.process(conn, msg) as fresh:
        if fresh:
            await conn.execute(
                "INSERT INTO applied VALUES ($1, $2)", inbox.event_id(msg), note or None
            )
    return bool(fresh)


async def applied(conn: asyncpg.Connection) -> dict[str, int]:
    rows = await conn.fetch("SELECT event_id, count(*) AS n FROM applied GROUP BY event_id")
    return {r["event_id"]: r["n"] for r in rows}


# --- the migration track ----------------------------------------------------------------------


async def test_inbox_track_migrates_verifies_and_lives_beside_the_outbox(empty_db_dsn: str) -> None:
    async with connect(empty_db_dsn) as conn:
        report = await verify_inbox(conn)
        assert report.pending == [1, 2]
        assert "notify-outbox migrate --inbox" in report.describe()
        assert await migrate_inbox(conn) == [1, 2]
        assert await migrate_inbox(conn) == []
        assert (await verify_inbox(conn)).ok
        # The outbox in the same database and schema: one tracking table, separate tracks.
        assert await migrate(conn, OutboxNames()) != []
        assert (await verify(conn, OutboxNames())).ok
        assert (await verify_inbox(conn)).ok
        targets = await conn.fetch(
            "SELECT target, version FROM notify_outbox_migrations ORDER BY target, version"
        )
        assert {r["target"] for r in targets} == {"public.outbox", "inbox:public.inbox"}
        # A second inbox under other names is a track of its own too.
        custom = InboxNames("select", "order")
        assert await migrate_inbox(conn, custom) == [1, 2]
        assert (await verify_inbox(conn, custom)).ok
        # Drift is reported.
        await conn.execute("DROP INDEX inbox_processed_at_idx")
        drifted = await verify_inbox(conn)
        assert not drifted.ok
        assert "missing index inbox_processed_at_idx" in "\n".join(drifted.schema_differences)


async def test_concurrent_inbox_migrations_are_safe(empty_db_dsn: str) -> None:
    conns = [await asyncpg.connect(empty_db_dsn) for _ in range(3)]
    try:
        results = await asyncio.gather(*(migrate_inbox(c) for c in conns))
        assert sorted(map(len, results)) == [0, 0, 2]
    finally:
        for c in conns:
            await c.close()


def test_inbox_cli(empty_db_dsn: str) -> None:
    def cli(*args: str, dsn: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "notify_outbox", *args, *(["--dsn", empty_db_dsn] * dsn)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )

    printed = cli("sql", "--inbox", dsn=False)
    assert printed.returncode == 0
    assert printed.stdout == render_inbox_migrations()
    before = cli("migrate", "--inbox", "--check")
    assert before.returncode == 4, before.stdout + before.stderr
    assert "pending migrations: [1, 2] (run `notify-outbox migrate --inbox`)" in before.stdout
    done = cli("migrate", "--inbox")
    assert done.returncode == 0, done.stderr
    assert "inbox: applied migrations [1, 2]" in done.stdout
    assert cli("verify", "--inbox").returncode == 0
    # The outbox is untouched by --inbox: still pending there.
    assert cli("verify").returncode == 4
    purged = cli("inbox", "purge", "--older-than", "30d")
    assert purged.returncode == 0, purged.stderr
    assert "purged 0 ids" in purged.stdout
    bad = cli("inbox", "purge", "--older-than", "soon")
    assert bad.returncode == 2
    assert "--older-than: invalid duration" in bad.stderr


# --- process() --------------------------------------------------------------------------------


async def test_a_repeat_is_skipped(inbox_db: str) -> None:
    inbox = Inbox(consumer="billing")
    msg = event()
    async with connect(inbox_db) as conn:
        assert await apply_once(conn, inbox, msg) is True
        assert await apply_once(conn, inbox, msg) is False
        assert await apply_once(conn, inbox, event(str(inbox.event_id(msg)).upper())) is False
        # Another consumer sharing the table applies it once too.
        assert await apply_once(conn, Inbox(consumer="search"), msg) is True
        assert list((await applied(conn)).values()) == [2]
        assert inbox.counts == {"fresh": 1, "duplicate": 2}


async def test_a_failure_rolls_back_both(inbox_db: str) -> None:
    inbox = Inbox()
    msg = event()
    async with connect(inbox_db) as conn:

        async def failing() -> None:
            async with conn.transaction(), inbox.process(conn, msg) as fresh:
                assert fresh
                await conn.execute("INSERT INTO applied VALUES ($1)", inbox.event_id(msg))
                raise RuntimeError("handler failed")

        with pytest.raises(RuntimeError, match="handler failed"):
            await failing()
        assert await applied(conn) == {}
        assert await conn.fetchval("SELECT count(*) FROM inbox") == 0
        # The retry applies it.
        assert await apply_once(conn, inbox, msg) is True
        assert await applied(conn) == {inbox.event_id(msg): 1}


async def wait_until_blocked(dsn: str, pid: int) -> None:
    """Until the backend ``pid`` waits on a lock (a condition with a deadline, not a sleep)."""
    async with connect(dsn) as watcher:
        query = "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1"
        with anyio.fail_after(10):
            while True:
                if await watcher.fetchval(query, pid) == "Lock":
                    return
                await anyio.sleep(0.01)


@pytest.mark.parametrize("first_outcome", ["commit", "rollback"])
async def test_concurrent_consumers_apply_an_event_once(inbox_db: str, first_outcome: str) -> None:
    """A rebalance: the old owner is still applying the event when the new owner gets it."""
    inbox = Inbox()
    msg = event()
    async with connect(inbox_db) as c1, connect(inbox_db) as c2:
        tx = c1.transaction()
        await tx.start()
        async with inbox.process(c1, msg) as fresh1:
            assert fresh1
            await c1.execute("INSERT INTO applied VALUES ($1, 'first')", inbox.event_id(msg))
        second = asyncio.create_task(apply_once(c2, inbox, msg, "second"))
        await wait_until_blocked(inbox_db, c2.get_server_pid())
        assert not second.done()
        if first_outcome == "commit":
            await tx.commit()
            assert await second is False
            expected = "first"
        else:
            await tx.rollback()
            assert await second is True
            expected = "second"
        assert await c1.fetch("SELECT note FROM applied") == [(expected,)]


async def test_many_concurrent_appliers_of_the_same_events(inbox_db: str) -> None:
    inbox = Inbox()
    msgs = [event() for _ in range(20)]
    pool = await asyncpg.create_pool(inbox_db, min_size=4, max_size=4)
    try:

        async def worker() -> None:
            for msg in msgs:
                async with pool.acquire() as conn:
                    await apply_once(conn, inbox, msg)

        await asyncio.gather(*(worker() for _ in range(4)))
        async with pool.acquire() as conn:
            counts = await applied(conn)
    finally:
        await pool.close()
    assert len(counts) == 20
    assert set(counts.values()) == {1}
    assert inbox.counts["fresh"] == 20
    assert inbox.counts["duplicate"] == 60


async def test_outside_a_transaction_is_refused(inbox_db: str) -> None:
    async with connect(inbox_db) as conn:
        with pytest.raises(NotInTransaction, match="inside the transaction"):
            async with Inbox().process(conn, event()):
                pass
        assert await conn.fetchval("SELECT count(*) FROM inbox") == 0


async def test_missing_table_names_the_migration(empty_db_dsn: str) -> None:
    async with connect(empty_db_dsn) as conn:
        with pytest.raises(
            InboxNotMigrated, match=r"migrate --inbox --schema public --table inbox"
        ):
            async with conn.transaction(), Inbox().process(conn, event()):
                pytest.fail("the body must not run without the inbox table")
        with pytest.raises(InboxNotMigrated):
            await purge_inbox(conn, timedelta(days=1))


async def test_bad_ids_raise_or_follow_the_policy(inbox_db: str) -> None:
    no_id = Msg([("trace", b"1")])
    malformed = Msg([("outbox-event-id", b"12345")])
    async with connect(inbox_db) as conn:
        for msg in (no_id, malformed):
            with pytest.raises(BadEventId):
                await apply_once(conn, Inbox(), msg)
        skip = Inbox(on_bad_id="skip")
        assert await _apply_bad(conn, skip, no_id) is False
        apply = Inbox(on_bad_id="apply")
        assert await _apply_bad(conn, apply, malformed) is True
        assert await _apply_bad(conn, apply, malformed) is True  # no deduplication: documented
        assert await conn.fetchval("SELECT count(*) FROM applied") == 2
        assert await conn.fetchval("SELECT count(*) FROM inbox") == 0
        assert skip.counts["bad_id_skipped"] == 1
        assert apply.counts["bad_id_applied"] == 2


async def _apply_bad(conn: asyncpg.Connection, inbox: Inbox, msg: Msg) -> bool:
    async with conn.transaction(), inbox.process(conn, msg) as fresh:
        if fresh:
            await conn.execute("INSERT INTO applied VALUES ('bad')")
    return bool(fresh)


async def test_purge_by_age(inbox_db: str) -> None:
    a, b = Inbox(consumer="a"), Inbox(consumer="b")
    async with connect(inbox_db) as conn:
        for inbox in (a, b):
            for _ in range(7):
                await apply_once(conn, inbox, event())
        await conn.execute("UPDATE inbox SET processed_at = now() - interval '40 days'")
        await apply_once(conn, a, event())  # recent: kept
        assert await a.purge(conn, timedelta(days=30)) == 7
        assert await purge_inbox(conn, timedelta(days=30), batch=3) == 7
        assert await conn.fetchval("SELECT count(*) FROM inbox") == 1


# --- the Kafka loop ---------------------------------------------------------------------------


async def test_consume_applies_each_event_once_and_commits_offsets(
    inbox_db: str, services: Services, topic: str
) -> None:
    ids = [str(uuid.uuid4()) for _ in range(20)]
    producer = AIOKafkaProducer(bootstrap_servers=services.bootstrap)
    await producer.start()
    try:
        # Every event twice, as after a relay crash, plus once more at the end.
        for eid in [*ids, *ids, ids[0]]:
            await producer.send_and_wait(
                topic,
                f"v-{eid}".encode(),
                key=eid.encode(),
                headers=[("outbox-event-id", eid.encode())],
            )
    finally:
        await producer.stop()

    group = f"g-{uuid.uuid4().hex[:8]}"
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=services.bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    inbox = Inbox(consumer=group)

    async def handler(conn: asyncpg.Connection, record: object) -> None:
        await conn.execute("INSERT INTO applied VALUES ($1)", inbox.event_id(record))  # type: ignore[arg-type]

    pool = await asyncpg.create_pool(inbox_db, min_size=1, max_size=2)
    await consumer.start()
    try:
        task = asyncio.create_task(consume(consumer, pool, handler, inbox=inbox))
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        ends = await consumer.end_offsets(tps)
        deadline = time.monotonic() + 60
        while True:
            committed = {tp: await consumer.committed(tp) for tp in tps}
            if all((committed[tp] or 0) >= ends[tp] for tp in tps):
                break
            assert not task.done(), task.exception()
            assert time.monotonic() < deadline, f"offsets not committed: {committed} vs {ends}"
            await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        async with pool.acquire() as conn:
            counts = await applied(conn)
    finally:
        await consumer.stop()
        await pool.close()
    assert counts == dict.fromkeys(ids, 1)
    assert inbox.counts["applied"] == 20
    assert inbox.counts["duplicate"] == 21


async def test_consume_refuses_auto_commit(inbox_db: str, services: Services) -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers=services.bootstrap, group_id="x")
    try:
        with pytest.raises(ConfigurationError, match="enable_auto_commit=False"):
            await consume(consumer, inbox_db, lambda c, m: asyncio.sleep(0), inbox=Inbox())
    finally:
        await consumer.stop()  # never started; left unclosed, its __del__ warns


# --- SQLAlchemy -------------------------------------------------------------------------------


async def test_sqlalchemy_async_session(inbox_db: str) -> None:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    engine = create_async_engine(inbox_db.replace("postgresql://", "postgresql+asyncpg://", 1))
    inbox = Inbox(consumer="orm")
    msg = event()
    try:

        async def apply(session: AsyncSession) -> bool:
            async with session.begin(), inbox.process(session, msg) as fresh:
                if fresh:
                    await session.execute(
                        text("INSERT INTO applied VALUES (:e)"), {"e": inbox.event_id(msg)}
                    )
            return bool(fresh)

        async with AsyncSession(engine) as session:
            assert await apply(session) is True
            assert await apply(session) is False
            with pytest.raises(NotInTransaction):
                async with inbox.process(session, msg):
                    pass
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM applied"))).scalar() == 1
        async with AsyncSession(engine) as session:
            elsewhere = Inbox(names=InboxNames(table="not_migrated"))
            with pytest.raises(InboxNotMigrated, match="migrate --inbox"):
                async with session.begin(), elsewhere.process(session, event()):
                    pass
    finally:
        await engine.dispose()
