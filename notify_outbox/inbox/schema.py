"""The inbox table: its validated names, its migration track, its queries, and purging it.

The table lives in the consumer's database; ``notify-outbox migrate --inbox`` (or
``migrate_inbox``) creates it, ``notify-outbox sql --inbox`` prints its migrations.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from datetime import timedelta

import asyncpg

from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.names import validate_identifier
from notify_outbox.pg.migrations import (
    MigrationTrack,
    VerifyReport,
    migrate_track,
    render_track,
    verify_track,
)
from notify_outbox.pg.sqlfiles import render_queries

from .errors import InboxNotMigrated

__all__ = [
    "INBOX_TRACK",
    "InboxNames",
    "migrate_inbox",
    "purge_inbox",
    "render_inbox_migrations",
    "verify_inbox",
]


@dataclass(frozen=True)
class InboxNames:
    """The validated names of one inbox table (in the consumer's database)."""

    schema: str = "public"
    table: str = "inbox"

    def __post_init__(self) -> None:
        validate_identifier(self.schema, "inbox schema")
        # Derived names (the primary key, the index) append suffixes.
        validate_identifier(self.table, "inbox table", max_length=40)

    @property
    def qualified_table(self) -> str:
        """The table, schema-qualified and quoted."""
        return f'"{self.schema}"."{self.table}"'

    @property
    def qualified_dead_letter(self) -> str:
        """The dead-letter table (``<table>_dead_letter``), schema-qualified and quoted."""
        return f'"{self.schema}"."{self.table}_dead_letter"'

    @property
    def target(self) -> str:
        """The inbox track's key in the tracking table, distinct from any outbox's."""
        return f"inbox:{self.schema}.{self.table}"

    @property
    def lock_namespace(self) -> int:
        """The bigint advisory key of ``migrate --inbox``: a stable signed 32-bit number."""
        n = zlib.crc32(f"notify_outbox:{self.target}".encode())
        return n - (1 << 32) if n >= (1 << 31) else n

    def substitutions(self) -> dict[str, str]:
        """Tokens of ``sql/inbox/`` and ``sql/inbox_queries.sql`` mapped to their text."""
        s = f'"{self.schema}"'
        return {
            "@schema@": s,
            "@table@": self.qualified_table,
            "@prefix@": self.table,
            "@dead_letter@": self.qualified_dead_letter,
            # The same tracking table as the outbox's: rows are keyed by ``target``.
            "@migrations@": f'{s}."notify_outbox_migrations"',
        }


INBOX_TRACK = MigrationTrack[InboxNames](
    folder="inbox",
    command="notify-outbox migrate --inbox",
    relations=lambda t: [t, f"{t}_dead_letter"],
    in_schema=lambda names, schema: InboxNames(schema, names.table),
)


async def migrate_inbox(conn: asyncpg.Connection, names: InboxNames | None = None) -> list[int]:
    """Create or upgrade the inbox table in the consumer's database; returns the versions
    applied. Safe to run concurrently (like ``migrate``)."""
    return await migrate_track(conn, INBOX_TRACK, names or InboxNames())


async def verify_inbox(conn: asyncpg.Connection, names: InboxNames | None = None) -> VerifyReport:
    """Compare the inbox table with the shipped inbox migrations (like ``verify``)."""
    return await verify_track(conn, INBOX_TRACK, names or InboxNames())


def render_inbox_migrations(names: InboxNames | None = None, *, since: int = 0) -> str:
    """The inbox migrations after ``since`` as one SQL script, for psql, Alembic or Flyway."""
    return render_track(INBOX_TRACK, names or InboxNames(), since=since)


async def purge_inbox(
    conn: asyncpg.Connection,
    older_than: timedelta,
    *,
    names: InboxNames | None = None,
    consumer: str | None = None,
    batch: int = 5000,
) -> int:
    """Delete ids processed more than ``older_than`` ago (of one consumer, or of all); returns
    how many. Runs in batches of short statements; do not call it inside a transaction.

    The trade-off: a message redelivered after its id was purged is applied *again*. Keep ids
    longer than the longest time a message can be redelivered: the topic's retention, or how
    long a consumer group may lag or be reset to an old offset.
    """
    if older_than <= timedelta(0):
        raise ConfigurationError("older_than must be a positive duration")
    if batch < 1:
        raise ConfigurationError("batch must be at least 1")
    sql = _queries(names or InboxNames())["purge"]
    total = 0
    while True:
        try:
            status = await conn.execute(sql, older_than, consumer, batch)
        except asyncpg.UndefinedTableError:
            raise _not_migrated(names or InboxNames()) from None
        deleted = int(status.split()[-1])
        total += deleted
        if deleted < batch:
            return total


_QUERIES: dict[InboxNames, dict[str, str]] = {}


def _queries(names: InboxNames) -> dict[str, str]:
    if names not in _QUERIES:
        _QUERIES[names] = render_queries("inbox_queries.sql", names)
    return _QUERIES[names]


def _not_migrated(names: InboxNames) -> InboxNotMigrated:
    return InboxNotMigrated(
        f"the inbox table {names.schema}.{names.table} does not exist in this database: run "
        f"`notify-outbox migrate --inbox --schema {names.schema} --table {names.table}` "
        "(or notify_outbox.inbox.migrate_inbox) against the consumer's database"
    )
