"""Migrations against a real PostgreSQL: apply, re-apply, run concurrently, verify, names."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import anyio
import asyncpg
import pytest

from notify_outbox import MigrationError, OutboxNames, migrate, render_migrations, verify
from notify_outbox.pg.sqlfiles import load_migrations
from tests.support import ROOT, logged

pytestmark = pytest.mark.anyio


async def test_migrate_applies_once_and_verify_matches(empty_db_dsn: str) -> None:
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        names = OutboxNames()
        assert (await verify(conn, names)).pending == [m.version for m in load_migrations()]
        assert await migrate(conn, names) == [m.version for m in load_migrations()]
        assert await migrate(conn, names) == []
        report = await verify(conn, names)
        assert report.ok, report.describe()
    finally:
        await conn.close()


async def test_concurrent_migrate_is_safe(empty_db_dsn: str) -> None:
    conns = [await asyncpg.connect(empty_db_dsn) for _ in range(4)]
    try:
        results = await asyncio.gather(*(migrate(c, OutboxNames()) for c in conns))
        assert sorted(map(len, results)) == [0, 0, 0, len(load_migrations())]
        assert (await verify(conns[0], OutboxNames())).ok
    finally:
        for c in conns:
            await c.close()


async def test_verify_reports_drift_and_tolerates_extra_indexes(db_dsn: str) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute("CREATE INDEX my_own_idx ON outbox (aggregate_id)")
        report = await verify(conn, OutboxNames())
        assert report.ok
        assert report.extras == ["index my_own_idx"]
        await conn.execute("DROP INDEX outbox_waiting_key_idx")
        await conn.execute("ALTER TABLE outbox DISABLE TRIGGER outbox_notify")
        report = await verify(conn, OutboxNames())
        assert not report.ok
        text = "\n".join(report.schema_differences)
        assert "missing index outbox_waiting_key_idx" in text
        assert "trigger outbox_notify" in text
    finally:
        await conn.close()


async def test_custom_names_with_reserved_words_work(empty_db_dsn: str) -> None:
    names = OutboxNames(schema="select", table="order", channel="user")
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        await migrate(conn, names)
        assert (await verify(conn, names)).ok
        # The default outbox and this one live side by side, each tracked on its own.
        await migrate(conn, OutboxNames())
        await conn.execute(
            """INSERT INTO "select"."order" (topic, key, payload) VALUES ('t', 'k', '{}')"""
        )
        assert await conn.fetchval('SELECT count(*) FROM "select"."order"') == 1
    finally:
        await conn.close()


async def test_printed_sql_builds_the_same_schema(empty_db_dsn: str, db_dsn: str) -> None:
    """`notify-outbox sql` is what Alembic/Flyway users apply: it must equal `migrate`."""
    result = await anyio.run_process([sys.executable, "-m", "notify_outbox", "sql"], cwd=ROOT)
    out = result.stdout.decode()
    assert out == render_migrations(OutboxNames())
    by_sql = await asyncpg.connect(empty_db_dsn)
    by_migrate = await asyncpg.connect(db_dsn)
    try:
        await by_sql.execute(out)
        catalog = (
            "SELECT string_agg(column_name || ' ' || data_type, ',' ORDER BY column_name) "
            "FROM information_schema.columns WHERE table_name IN ('outbox', 'outbox_dead_letter')"
        )
        assert await by_sql.fetchval(catalog) == await by_migrate.fetchval(catalog)
    finally:
        await by_sql.close()
        await by_migrate.close()


def test_cli_check_exit_codes(empty_db_dsn: str) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "notify_outbox", *args, "--dsn", empty_db_dsn],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )

    before = cli("migrate", "--check")
    assert before.returncode == 4, before.stdout + before.stderr
    assert "pending migrations" in before.stdout
    assert cli("migrate").returncode == 0
    after = cli("verify")
    assert after.returncode == 0
    assert "up to date" in after.stdout


# Producers under an online upgrade (0005 -> 0006 takes the outbox's table lock).
_INSERT = "INSERT INTO outbox (topic, key, payload) VALUES ('t', 'k', '{}')"


async def _at_0005(dsn: str) -> asyncpg.Connection:
    conn = await asyncpg.connect(dsn)
    assert await migrate(conn, OutboxNames(), up_to=5) == [1, 2, 3, 4, 5]
    return conn


async def _rolled_back_savepoint(dsn: str) -> asyncpg.Connection:
    """A producer whose transaction inserted inside a savepoint it rolled back, and goes on:
    nextval() keeps the id sequence locked for the whole transaction, the table lock went with
    the savepoint."""
    producer = await asyncpg.connect(dsn)
    await producer.execute(f"BEGIN; SAVEPOINT s; {_INSERT}; ROLLBACK TO SAVEPOINT s")
    return producer


async def test_upgrade_never_locks_a_default_sequence_a_savepoint_holds(
    empty_db_dsn: str,
) -> None:
    """0006 keeps the sequence's CACHE 1 as it finds it, without locking the sequence: the
    ALTER SEQUENCE it ran before waited for the producer below, whose next insert waited for
    the table lock 0006 holds: "deadlock detected" in CI (scenario 30)."""
    conn = await _at_0005(empty_db_dsn)
    producer = await _rolled_back_savepoint(empty_db_dsn)
    try:
        # No retry allowed: the first attempt must not wait for any lock.
        assert await migrate(conn, OutboxNames(), retry_for=0) == [6, 7, 8, 9]
        await producer.execute(_INSERT)
        await producer.execute("COMMIT")
        assert await conn.fetchval("SELECT count(*) FROM outbox") == 1
    finally:
        await producer.close()
        await conn.close()


async def test_upgrade_that_must_alter_the_sequence_gives_way_to_producers(
    empty_db_dsn: str,
) -> None:
    """Where a cache was set, 0006 must lock the sequence, and the savepoint producer holds it:
    the migration gives up and tries again (never the producer), and lands once the producer
    commits."""
    conn = await _at_0005(empty_db_dsn)
    await conn.execute("ALTER SEQUENCE outbox_id_seq CACHE 20")
    producer = await _rolled_back_savepoint(empty_db_dsn)
    try:
        with logged("notify_outbox.migrations", "attempt 1 met a lock") as retried:
            upgrade = asyncio.ensure_future(migrate(conn, OutboxNames(), retry_for=60))
            await asyncio.wait_for(retried.wait(), timeout=30)
        # Its insert waits for the migration's next attempt to give up, at most.
        await asyncio.wait_for(producer.execute(_INSERT), timeout=30)
        await producer.execute("COMMIT")
        assert await asyncio.wait_for(upgrade, timeout=30) == [6, 7, 8, 9]
        seqcache = "SELECT seqcache FROM pg_sequence WHERE seqrelid = 'outbox_id_seq'::regclass"
        assert await conn.fetchval(seqcache) == 1
        assert await conn.fetchval("SELECT count(*) FROM outbox") == 1
    finally:
        await producer.close()
        await conn.close()


async def test_upgrade_behind_a_long_transaction_holds_producers_briefly_then_says_why(
    empty_db_dsn: str,
) -> None:
    """A transaction that keeps the outbox (a batch job, an idle session) blocks the upgrade.
    Producers queued behind the upgrade's table lock must not wait for that transaction too,
    and the upgrade ends with an error that says what blocked it."""
    conn = await _at_0005(empty_db_dsn)
    long = await asyncpg.connect(empty_db_dsn)
    producer = await asyncpg.connect(empty_db_dsn)
    try:
        # Another key: same-key producers wait for each other anyway (commit order).
        await long.execute(
            "BEGIN; INSERT INTO outbox (topic, key, payload) VALUES ('t', 'o', '{}')"
        )
        upgrade = asyncio.ensure_future(migrate(conn, OutboxNames(), retry_for=3))
        for _ in range(3):  # each insert finds the upgrade waiting or between attempts
            await asyncio.wait_for(producer.execute(_INSERT), timeout=30)
        with pytest.raises(MigrationError, match="long transaction"):
            await asyncio.wait_for(upgrade, timeout=60)
        assert (await verify(conn, OutboxNames())).pending == [6, 7, 8, 9]
        await long.execute("COMMIT")
        assert await migrate(conn, OutboxNames(), retry_for=0) == [6, 7, 8, 9]
    finally:
        for c in (producer, long, conn):
            await c.close()
