"""Migrations against a real PostgreSQL: apply, re-apply, run concurrently, verify, names."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import anyio
import asyncpg
import pytest

from notify_outbox import OutboxNames, migrate, render_migrations, verify
from notify_outbox.sqlfiles import load_migrations
from tests.support import ROOT

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
