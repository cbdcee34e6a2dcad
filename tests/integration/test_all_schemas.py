"""A schema per tenant (issue #34, operations): the migrated outboxes of a database found from
their migration records, with their channels, and the admin commands run on all of them with
``--all-schemas``, against a real PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys

import anyio
import asyncpg
import pytest

from notify_outbox import OutboxNames, migrate
from notify_outbox.inbox import migrate_inbox
from notify_outbox.pg.discovery import discover_outboxes
from notify_outbox.pg.sqlfiles import load_migrations
from tests.conftest import Services
from tests.support import ROOT, consume

pytestmark = pytest.mark.anyio

LATEST = max(m.version for m in load_migrations())


def cli(
    dsn: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("NOTIFY_OUTBOX_")}
    return subprocess.run(
        [sys.executable, "-m", "notify_outbox", *args],
        env={**base, **(env or {}), "NOTIFY_OUTBOX_DSN": dsn, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def _tenants(dsn: str) -> None:
    """Three tenants' outboxes, one behind the shipped migrations and one on its own channel;
    a table of another name; an inbox; a tenant whose outbox was dropped."""
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn, OutboxNames("tenant_a"))
        await migrate(conn, OutboxNames("tenant_b", channel="tenant_b_events"))
        await migrate(conn, OutboxNames("tenant_c"), up_to=LATEST - 1)
        await migrate(conn, OutboxNames("tenant_a", "audit_outbox"))
        await migrate_inbox(conn)
        await migrate(conn, OutboxNames("gone"))
        await conn.execute("DROP TABLE gone.outbox CASCADE")
    finally:
        await conn.close()


async def test_discovery_finds_each_migrated_outbox_with_its_channel(empty_db_dsn: str) -> None:
    await _tenants(empty_db_dsn)
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        every = {f.names: f.versions for f in await discover_outboxes(conn)}
        named = [f.names for f in await discover_outboxes(conn, table="outbox")]
    finally:
        await conn.close()
    full = tuple(range(1, LATEST + 1))
    assert every == {
        OutboxNames("tenant_a"): full,
        OutboxNames("tenant_a", "audit_outbox"): full,
        OutboxNames("tenant_b", channel="tenant_b_events"): full,
        OutboxNames("tenant_c"): full[:-1],
    }
    assert named == [
        OutboxNames("tenant_a"),
        OutboxNames("tenant_b", channel="tenant_b_events"),
        OutboxNames("tenant_c"),
    ]


async def test_migrate_verify_and_notify_mode_on_all_schemas(empty_db_dsn: str) -> None:
    await _tenants(empty_db_dsn)
    # tenant_c is behind: verify says so for it alone, with exit 4.
    check = cli(empty_db_dsn, "verify", "--all-schemas")
    assert check.returncode == 4, check.stderr
    lines = check.stdout.splitlines()
    assert any(line.startswith("tenant_c.outbox: pending migrations: [") for line in lines)
    assert sum(line.startswith("tenant_a.outbox: up to date") for line in lines) == 1
    assert sum(line.startswith("tenant_b.outbox: up to date") for line in lines) == 1
    assert not any("audit_outbox" in line or "gone" in line for line in lines)

    done = cli(empty_db_dsn, "migrate", "--all-schemas")
    assert done.returncode == 0, done.stderr
    assert f"tenant_c.outbox: applied migrations [{LATEST}]" in done.stdout.splitlines()
    assert "tenant_a.outbox: already up to date" in done.stdout.splitlines()
    # Verified with the channel each was built with: tenant_b's trigger is unchanged.
    assert cli(empty_db_dsn, "migrate", "--check", "--all-schemas").returncode == 0

    assert cli(empty_db_dsn, "notify-mode", "always", "--all-schemas").returncode == 0
    shown = cli(empty_db_dsn, "notify-mode", "--all-schemas")
    assert shown.stdout.splitlines() == [
        "tenant_a.outbox: always",
        "tenant_b.outbox: always",
        "tenant_c.outbox: always",
    ]
    audit = cli(empty_db_dsn, "notify-mode", "--schema", "tenant_a", "--table", "audit_outbox")
    assert audit.stdout.strip() == "gated", "an outbox of another table name is left alone"


async def test_all_schemas_refuses_a_schema_and_says_when_nothing_is_found(
    empty_db_dsn: str,
) -> None:
    both = cli(empty_db_dsn, "migrate", "--all-schemas", "--schema", "tenant_a")
    assert both.returncode == 2
    assert "does not go with --schema" in both.stderr
    none = cli(empty_db_dsn, "verify", "--all-schemas")
    assert none.returncode == 0
    assert "no migrated outbox table named 'outbox'" in none.stderr


async def test_dead_letters_on_all_schemas(empty_db_dsn: str) -> None:
    """Each tenant's dead letters listed and requeued under its own outbox."""
    await _tenants(empty_db_dsn)
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        for schema in ("tenant_a", "tenant_c"):
            await conn.execute(
                f"INSERT INTO {schema}.outbox_dead_letter (id, event_id, topic, key, created_at, "
                "attempts, error) VALUES (1, gen_random_uuid(), 'orders', 'k', now(), 3, 'boom')"
            )
    finally:
        await conn.close()
    listed = cli(empty_db_dsn, "dead-letters", "list", "--all-schemas", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    tenants = sorted(line.split(":", 1)[0] for line in listed.stdout.splitlines())
    assert tenants == ["tenant_a.outbox", "tenant_c.outbox"]
    moved = cli(empty_db_dsn, "dead-letters", "requeue", "--all", "--all-schemas")
    assert moved.returncode == 0, moved.stderr
    assert sum("requeued 1 dead letter" in line for line in moved.stdout.splitlines()) == 2
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        for schema in ("tenant_a", "tenant_c"):
            assert await conn.fetchval(f"SELECT count(*) FROM {schema}.outbox") == 1
            assert await conn.fetchval(f"SELECT count(*) FROM {schema}.outbox_dead_letter") == 0
    finally:
        await conn.close()


async def test_replay_on_all_schemas(empty_db_dsn: str, services: Services, topic: str) -> None:
    """Kept published rows of one topic replayed from every tenant's outbox."""
    await _tenants(empty_db_dsn)
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        for schema in ("tenant_a", "tenant_b"):
            await conn.execute(
                f"INSERT INTO {schema}.outbox (topic, key, payload, published_at) "
                f"VALUES ($1, '{schema}', '{{}}', now())",
                topic,
            )
    finally:
        await conn.close()
    replayed = await anyio.to_thread.run_sync(
        lambda: cli(
            empty_db_dsn,
            "replay",
            "--all-schemas",
            "--topic",
            topic,
            "--since",
            "1h",
            env={
                "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.bootstrap,
                "NOTIFY_OUTBOX_KEEP_PUBLISHED": "3600",
            },
        )
    )
    assert replayed.returncode == 0, replayed.stderr
    assert sum(line.startswith("tenant_") for line in replayed.stdout.splitlines()) == 3
    records, _ = await consume(services.bootstrap, topic, expect=2, within=60)
    assert sorted(r.key for r in records) == [b"tenant_a", b"tenant_b"]


async def test_migrate_all_schemas_creates_new_tenants_outboxes(empty_db_dsn: str) -> None:
    """``--schemas-like``: a new tenant's schema gets its outbox with the others' upgrade; a
    schema outside the pattern does not."""
    await _tenants(empty_db_dsn)
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        await conn.execute("CREATE SCHEMA tenant_new; CREATE SCHEMA reporting")
    finally:
        await conn.close()
    done = cli(empty_db_dsn, "migrate", "--all-schemas", "--schemas-like", "tenant\\_%")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"tenant_new.outbox: applied migrations {list(range(1, LATEST + 1))}" in lines
    assert f"tenant_c.outbox: applied migrations [{LATEST}]" in lines
    assert not any(line.startswith("reporting.") for line in lines)
    assert cli(empty_db_dsn, "verify", "--all-schemas").returncode == 0
    alone = cli(empty_db_dsn, "migrate", "--schemas-like", "tenant_%")
    assert alone.returncode == 2
    assert "--schemas-like goes with --all-schemas" in alone.stderr
