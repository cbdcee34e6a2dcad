"""The schema as truth: sql/schema.sql (sql/inbox_schema.sql) is exactly what the outbox's
(inbox's) migrations, applied in order, make. Each is applied to a fresh database of its own,
for the default names and for others, and the two catalogs are compared as ``pg_dump
--schema-only`` prints them (every column with its type, default and nullability, every
constraint, index, function body, trigger, sequence setting and table option), with the
configuration rows."""

from __future__ import annotations

import asyncio
import difflib
import uuid
from collections.abc import Iterator

import asyncpg
import pytest

from notify_outbox.core.names import OutboxNames
from notify_outbox.inbox.schema import InboxNames
from notify_outbox.pg.migrations import TrackNames
from tests.conftest import Services
from tests.support import dsn_with_database
from tools.schema import REGENERATE, SCHEMAS, SchemaFile, apply_migrations, apply_schema, dump

pytestmark = pytest.mark.anyio

OUTBOX, INBOX = SCHEMAS
NAMES: dict[str, TrackNames] = {
    "outbox default names": OutboxNames(),
    # A reserved word as the table, as pg_dump must quote it (and a schema of its own).
    "outbox other names": OutboxNames(schema="shop", table="order", channel="shop_events"),
    "inbox default names": InboxNames(),
    "inbox other names": InboxNames(schema="billing", table="seen"),
}


@pytest.fixture
def two_databases(services: Services) -> Iterator[tuple[str, str]]:
    """Two fresh, empty databases: one for the migrations, one for the schema file."""
    names = [f"s_{uuid.uuid4().hex[:16]}" for _ in range(2)]

    async def admin(statement: str) -> None:
        conn = await asyncpg.connect(services.dsn)
        try:
            for name in names:
                await conn.execute(statement.format(name))
        finally:
            await conn.close()

    asyncio.run(admin('CREATE DATABASE "{}"'))
    try:
        yield dsn_with_database(services.dsn, names[0]), dsn_with_database(services.dsn, names[1])
    finally:
        asyncio.run(admin('DROP DATABASE IF EXISTS "{}" WITH (FORCE)'))


@pytest.mark.parametrize("case", sorted(NAMES))
async def test_the_schema_file_is_what_the_migrations_make(
    case: str, two_databases: tuple[str, str]
) -> None:
    schema: SchemaFile = OUTBOX if case.startswith("outbox") else INBOX
    names = NAMES[case]
    migrated_dsn, declared_dsn = two_databases
    migrated = await asyncpg.connect(migrated_dsn)
    declared = await asyncpg.connect(declared_dsn)
    try:
        await apply_migrations(migrated, schema.folder, names)
        await apply_schema(declared, schema, names)
    finally:
        await migrated.close()
        await declared.close()
    tables = schema.data_tables(names)
    from_migrations = dump(migrated_dsn, names.schema, tables)
    from_file = dump(declared_dsn, names.schema, tables)
    # Not vacuous: the dump holds the track's objects, and the rows asked for.
    assert f"CREATE TABLE {names.schema}." in from_migrations.replace('"', "")
    if tables:
        assert "INSERT INTO " in from_migrations
    if from_file != from_migrations:
        diff = "\n".join(
            list(
                difflib.unified_diff(
                    from_migrations.splitlines(),
                    from_file.splitlines(),
                    f"migrations of sql/{schema.folder}/",
                    str(schema.path.name),
                    lineterm="",
                )
            )[:80]
        )
        pytest.fail(
            f"{schema.path.name} is not what the migrations make ({case}); regenerate it with "
            f"`{REGENERATE}` (python -m tools.schema):\n{diff}",
            pytrace=False,
        )
