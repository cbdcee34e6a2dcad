"""notify_outbox.alembic and notify_outbox.sqlalchemy.outbox_tables with a real Alembic
project against the real PostgreSQL: ``alembic upgrade`` runs the outbox's multi-statement
migrations under asyncpg (an async engine, as in Alembic's async template) and under
psycopg, idempotently; autogenerate proposes nothing for the outbox's tables."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import BigInteger, Column, Connection, MetaData, Table, Text
from sqlalchemy.ext.asyncio import create_async_engine

from notify_outbox import OutboxNames, migrate, verify
from notify_outbox.producer.alembic import include_object
from notify_outbox.producer.sqlalchemy import outbox_tables
from tests.support import ROOT

ENV_PY = '''
"""env.py of a user's project: an async engine under asyncpg (Alembic's async template),
a plain engine otherwise."""
import asyncio
import os

import sqlalchemy as sa
from alembic import context
from sqlalchemy import engine_from_config, pool
from sqlalchemy.ext.asyncio import async_engine_from_config

from notify_outbox.producer.alembic import include_object
from notify_outbox.producer.sqlalchemy import outbox_tables

config = context.config

# The user's models; the test chooses how the outbox is kept out of autogenerate.
target_metadata = sa.MetaData()
sa.Table(
    "orders",
    target_metadata,
    sa.Column("id", sa.BigInteger, primary_key=True),
    sa.Column("customer", sa.Text, nullable=False),
)
hook = None
if os.environ["OUTBOX_AUTOGENERATE"] == "include_object":
    hook = include_object()
elif os.environ["OUTBOX_AUTOGENERATE"] == "tables":
    outbox_tables(target_metadata)


def do_run_migrations(connection):
    context.configure(
        connection=connection, target_metadata=target_metadata, include_object=hook
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_async_migrations():
    engine = async_engine_from_config(
        config.get_section(config.config_ini_section, {}),
        prefix="sqlalchemy.",
        poolclass=pool.NullPool,
    )
    async with engine.connect() as connection:
        await connection.run_sync(do_run_migrations)
    await engine.dispose()


url = config.get_main_option("sqlalchemy.url")
if url.startswith("postgresql+asyncpg"):
    asyncio.run(run_async_migrations())
else:
    engine = engine_from_config(
        config.get_section(config.config_ini_section, {}),
        prefix="sqlalchemy.",
        poolclass=pool.NullPool,
    )
    with engine.connect() as connection:
        do_run_migrations(connection)
'''

REVISIONS = {
    # The business table and the outbox up to migration 5 (as with an older release)...
    "0001_orders_and_outbox.py": """
        import sqlalchemy as sa
        from alembic import op

        from notify_outbox.producer.alembic import upgrade_outbox

        revision = "0001"
        down_revision = None


        def upgrade():
            op.create_table(
                "orders",
                sa.Column("id", sa.BigInteger, primary_key=True),
                sa.Column("customer", sa.Text, nullable=False),
            )
            print("outbox migrations applied:", upgrade_outbox(op, up_to=5))
    """,
    # ...then a later release's migration, in a revision of its own...
    "0002_outbox_6.py": """
        from alembic import op

        from notify_outbox.producer.alembic import upgrade_outbox

        revision = "0002"
        down_revision = "0001"


        def upgrade():
            print("outbox migrations applied:", upgrade_outbox(op, up_to=6))


        def downgrade():
            pass  # the outbox stays: its migrations have no way down
    """,
    # ...and the same line once more: nothing left to do.
    "0003_outbox_again.py": """
        from alembic import op

        from notify_outbox.producer.alembic import upgrade_outbox

        revision = "0003"
        down_revision = "0002"


        def upgrade():
            print("outbox migrations applied:", upgrade_outbox(op))


        def downgrade():
            pass
    """,
}


def sqlalchemy_url(dsn: str, driver: str) -> str:
    return dsn.replace("postgresql://", f"postgresql+{driver}://", 1)


def alembic_project(base: Path, url: str, revisions: dict[str, str] = REVISIONS) -> Path:
    """A user's Alembic project in ``base``; returns its alembic.ini."""
    (base / "migrations" / "versions").mkdir(parents=True)
    (base / "migrations" / "env.py").write_text(ENV_PY)
    for name, body in revisions.items():
        (base / "migrations" / "versions" / name).write_text(textwrap.dedent(body))
    ini = base / "alembic.ini"
    ini.write_text(f"[alembic]\nscript_location = {base / 'migrations'}\nsqlalchemy.url = {url}\n")
    return ini


def alembic(ini: Path, *args: str, autogenerate: str = "include_object", ok: bool = True) -> str:
    """Run the ``alembic`` command line; its output (stdout, then stderr)."""
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(ini), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OUTBOX_AUTOGENERATE": autogenerate},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (result.returncode == 0) == ok, result.stdout + result.stderr
    return result.stdout + result.stderr


async def outbox_objects(dsn: str) -> dict[str, Any]:
    conn = await asyncpg.connect(dsn)
    try:
        tables = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename"
        )
        triggers = await conn.fetch(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'public.outbox'::regclass "
            "AND NOT tgisinternal ORDER BY tgname"
        )
        versions = await conn.fetch(
            "SELECT version FROM notify_outbox_migrations WHERE target = 'public.outbox' "
            "ORDER BY version"
        )
        report = await verify(conn, OutboxNames())
        head = await conn.fetchval("SELECT version_num FROM alembic_version")
    finally:
        await conn.close()
    return {
        "tables": [r["tablename"] for r in tables],
        "triggers": [r["tgname"] for r in triggers],
        "versions": [r["version"] for r in versions],
        "verify": report,
        "head": head,
    }


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
def test_alembic_upgrade_applies_the_outbox_migrations_idempotently(
    empty_db_dsn: str, tmp_path: Path, driver: str
) -> None:
    ini = alembic_project(tmp_path, sqlalchemy_url(empty_db_dsn, driver))

    out = alembic(ini, "upgrade", "0001")
    assert "outbox migrations applied: [1, 2, 3, 4, 5]" in out
    first = asyncio.run(outbox_objects(empty_db_dsn))
    assert first["versions"] == [1, 2, 3, 4, 5]
    assert first["verify"].pending == [6, 7, 8, 9]
    assert first["head"] == "0001"

    out = alembic(ini, "upgrade", "head")
    assert "outbox migrations applied: [6]" in out
    assert "outbox migrations applied: [7, 8, 9]" in out  # 0003: the same line, what came after
    done = asyncio.run(outbox_objects(empty_db_dsn))
    assert done["tables"] == [
        "alembic_version",
        "notify_outbox_migrations",
        "orders",
        "outbox",
        "outbox_config",
        "outbox_dead_letter",
        "outbox_eos_slot",
        "outbox_eos_stamp",
    ]
    assert done["triggers"] == ["outbox_notify", "outbox_order_key"]
    assert done["versions"] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # Exactly the schema `notify-outbox migrate` makes: every column, index, trigger, function.
    assert done["verify"].ok, done["verify"].describe()
    assert done["verify"].extras == []
    assert done["head"] == "0003"

    # `alembic check` (autogenerate against the migrated database): nothing to do with
    # include_object() or with the outbox's tables declared; without either, it proposes to
    # drop them.
    assert "No new upgrade operations detected" in alembic(ini, "check")
    assert "No new upgrade operations detected" in alembic(ini, "check", autogenerate="tables")
    unhelped = alembic(ini, "check", autogenerate="none", ok=False)
    assert "remove_table" in unhelped
    assert "outbox_dead_letter" in unhelped

    # Down to the first revision and up again: its outbox line runs once more, and finds
    # everything applied.
    alembic(ini, "downgrade", "0001")
    out = alembic(ini, "upgrade", "head")
    assert out.count("outbox migrations applied: []") == 2
    again = asyncio.run(outbox_objects(empty_db_dsn))
    assert again["versions"] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert again["verify"].ok, again["verify"].describe()


def user_metadata() -> MetaData:
    metadata = MetaData()
    Table(
        "orders",
        metadata,
        Column("id", BigInteger, primary_key=True),
        Column("customer", Text, nullable=False),
    )
    return metadata


def autogenerate_diff(dsn: str, metadata: MetaData, **opts: Any) -> list[Any]:
    """What ``alembic revision --autogenerate`` would propose, under asyncpg."""

    def compare(connection: Connection) -> list[Any]:
        context = MigrationContext.configure(connection, opts={"compare_type": True, **opts})
        return list(compare_metadata(context, metadata))

    async def run() -> list[Any]:
        engine = create_async_engine(sqlalchemy_url(dsn, "asyncpg"))
        try:
            async with engine.connect() as connection:
                return await connection.run_sync(compare)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def dropped_tables(diff: list[Any]) -> set[str]:
    return {op[1].name for op in diff if isinstance(op, tuple) and op[0] == "remove_table"}


async def create_orders(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CREATE TABLE orders (id bigint PRIMARY KEY, customer text NOT NULL)")
    finally:
        await conn.close()


def test_autogenerate_proposes_to_drop_the_outbox_without_help(db_dsn: str) -> None:
    asyncio.run(create_orders(db_dsn))
    assert dropped_tables(autogenerate_diff(db_dsn, user_metadata())) == {
        "notify_outbox_migrations",
        "outbox",
        "outbox_config",
        "outbox_dead_letter",
        "outbox_eos_slot",
        "outbox_eos_stamp",
    }


def test_autogenerate_leaves_the_outbox_alone_with_include_object(db_dsn: str) -> None:
    asyncio.run(create_orders(db_dsn))
    diff = autogenerate_diff(db_dsn, user_metadata(), include_object=include_object())
    assert diff == []


def test_autogenerate_finds_the_outbox_tables_as_declared(db_dsn: str) -> None:
    asyncio.run(create_orders(db_dsn))
    metadata = user_metadata()
    tables = outbox_tables(metadata)
    assert tables.outbox.name == "outbox"
    assert tables.outbox.schema is None
    # Columns, types, nullability, keys and indexes as reflected: nothing to do, nothing to
    # drop. Server defaults too (compare_server_default).
    diff = autogenerate_diff(db_dsn, metadata, compare_server_default=True)
    assert diff == []


def test_upgrade_outbox_refuses_offline_mode(empty_db_dsn: str, tmp_path: Path) -> None:
    ini = alembic_project(tmp_path, sqlalchemy_url(empty_db_dsn, "asyncpg"))
    out = alembic(ini, "upgrade", "0001", "--sql", ok=False)
    assert "upgrade_outbox needs a database connection" in out
    assert "notify-outbox sql" in out


FAILING_REVISION = {
    "0001_fails.py": """
        from alembic import op

        from notify_outbox.producer.alembic import upgrade_outbox

        revision = "0001"
        down_revision = None


        def upgrade():
            upgrade_outbox(op)
            raise RuntimeError("a later step of the revision fails")
    """
}


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
def test_upgrade_outbox_rolls_back_with_its_revision(
    empty_db_dsn: str, tmp_path: Path, driver: str
) -> None:
    ini = alembic_project(tmp_path, sqlalchemy_url(empty_db_dsn, driver), FAILING_REVISION)
    out = alembic(ini, "upgrade", "head", ok=False)
    assert "a later step of the revision fails" in out

    async def left() -> list[str]:
        conn = await asyncpg.connect(empty_db_dsn)
        try:
            rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        finally:
            await conn.close()
        return [r["tablename"] for r in rows]

    # The migrations ran in the revision's transaction: nothing of them is left.
    assert asyncio.run(left()) == []


def test_autogenerate_with_an_outbox_of_other_names_in_its_own_schema(empty_db_dsn: str) -> None:
    names = OutboxNames(schema="events", table="shop_outbox", channel="shop")

    async def prepare() -> None:
        conn = await asyncpg.connect(empty_db_dsn)
        try:
            await migrate(conn, names)
        finally:
            await conn.close()

    asyncio.run(prepare())
    asyncio.run(create_orders(empty_db_dsn))
    # Every schema compared (include_schemas): the outbox's own is found and left alone...
    diff = autogenerate_diff(
        empty_db_dsn, user_metadata(), include_schemas=True, include_object=include_object(names)
    )
    assert diff == []
    # ...or found as declared, table for table.
    metadata = user_metadata()
    tables = outbox_tables(metadata, names)
    assert {t.fullname for t in vars(tables).values()} == {
        "events.shop_outbox",
        "events.shop_outbox_dead_letter",
        "events.shop_outbox_config",
        "events.shop_outbox_eos_slot",
        "events.shop_outbox_eos_stamp",
        "events.notify_outbox_migrations",
    }
    diff = autogenerate_diff(
        empty_db_dsn, metadata, include_schemas=True, compare_server_default=True
    )
    assert diff == []
