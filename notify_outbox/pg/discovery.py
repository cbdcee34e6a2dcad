"""Which outboxes a database holds (issue #34: a schema per tenant): every outbox this library
migrated, found from its migration records, with the NOTIFY channel its trigger was built with.

A migrated outbox records its migrations in ``<schema>.notify_outbox_migrations`` under its
target ``schema.table``; the outbox track's first migration is named ``outbox`` (the inbox
track's, in the same tables, ``inbox``). The channel is not recorded there: it was rendered
into the outbox's notify function at migration time, and a later migration that redefines
that function must render the same one, so it is read back from the function.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import asyncpg

from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.names import OutboxNames, validate_identifier

__all__ = ["FoundOutbox", "discover_outboxes", "schemas_like"]

# Schemas holding a migrations table; every name is checked before it goes into SQL.
_TRACKING_TABLES = """
SELECT n.nspname AS schema
FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE c.relname = 'notify_outbox_migrations' AND c.relkind IN ('r', 'p')
ORDER BY 1
"""
# Of one outbox: whether its table still exists, and its notify function's source.
_OUTBOX_STATE = """
SELECT to_regclass(format('%I.%I', $1::text, $2::text)) IS NOT NULL AS exists,
       (SELECT p.prosrc FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
        WHERE n.nspname = $1 AND p.proname = $2 || '_notify' AND p.pronargs = 0
        LIMIT 1) AS notify_source
"""
_CHANNEL = re.compile(r"pg_notify\('([a-z_][a-z0-9_]*)'")


@dataclass(frozen=True)
class FoundOutbox:
    """A migrated outbox of the database: its names (with the channel its trigger notifies)
    and the migration versions recorded for it."""

    names: OutboxNames
    versions: tuple[int, ...]


async def discover_outboxes(
    conn: asyncpg.Connection, *, table: str | None = None
) -> list[FoundOutbox]:
    """Every outbox migrated in the database of ``conn`` (only those whose table is named
    ``table``, if given), in schema and table order. An outbox whose table was dropped is left
    out; so is a record whose names are not valid identifiers (nothing this library wrote).
    Two statements plus one per outbox found."""
    schemas = [r["schema"] for r in await conn.fetch(_TRACKING_TABLES)]
    valid = [s for s in schemas if _valid(s, "schema")]
    if not valid:
        return []
    union = " UNION ALL ".join(
        f"SELECT target, version FROM {_q(s)}.notify_outbox_migrations "
        "WHERE target IN (SELECT target FROM "
        f"{_q(s)}.notify_outbox_migrations WHERE version = 1 AND name = 'outbox')"
        for s in valid
    )
    versions: dict[str, list[int]] = {}
    for r in await conn.fetch(f"SELECT target, version FROM ({union}) AS t ORDER BY 1, 2"):
        versions.setdefault(r["target"], []).append(int(r["version"]))
    found = []
    for target, applied in sorted(versions.items()):
        schema, _, name = target.partition(".")
        if not (_valid(schema, "schema") and _valid(name, "table")):
            continue
        if table is not None and name != table:
            continue
        state = await conn.fetchrow(_OUTBOX_STATE, schema, name)
        if state is None or not state["exists"]:
            continue
        source = state["notify_source"] or ""
        match = _CHANNEL.search(source)
        names = (
            OutboxNames(schema, name, match.group(1))
            if match
            else OutboxNames(schema, name)  # no notify function: the default channel
        )
        found.append(FoundOutbox(names, tuple(applied)))
    return found


async def schemas_like(conn: asyncpg.Connection, pattern: str) -> list[str]:
    """The schemas of the database whose name matches the SQL LIKE ``pattern`` (a tenant
    naming rule such as ``tenant_%``), leaving out PostgreSQL's own and names this library
    cannot use, in name order."""
    rows = await conn.fetch(
        "SELECT nspname FROM pg_namespace WHERE nspname LIKE $1 "
        "AND nspname NOT LIKE 'pg\\_%' AND nspname <> 'information_schema' ORDER BY 1",
        pattern,
    )
    return [r["nspname"] for r in rows if _valid(r["nspname"], "schema")]


def _valid(name: str, what: str) -> bool:
    try:
        validate_identifier(name, what)
    except ConfigurationError:
        return False
    return True


def _q(name: str) -> str:
    return f'"{name}"'
