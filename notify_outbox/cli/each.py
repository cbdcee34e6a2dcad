"""``--all-schemas``: a command run on every migrated outbox of the database (a schema per
tenant), each line of its output (and of its errors) prefixed with the outbox
(``schema.table:``)."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Awaitable, Callable
from typing import TextIO, TypeVar

import asyncpg

from notify_outbox.core.errors import MigrationError, NotifyOutboxError
from notify_outbox.core.names import OutboxNames
from notify_outbox.core.settings import DatabaseSettings
from notify_outbox.pg.discovery import discover_outboxes, schemas_like

__all__ = ["EXIT_FAILED", "EXIT_OK", "for_names", "for_outboxes"]

EXIT_OK, EXIT_FAILED = 0, 1

S = TypeVar("S", bound=DatabaseSettings)
OneOutbox = Callable[[asyncpg.Connection, OutboxNames], Awaitable[int]]
Connect = Callable[[DatabaseSettings], Awaitable[asyncpg.Connection]]


def for_names(settings: S, names: OutboxNames) -> S:
    """``settings`` for another outbox of the same database."""
    return settings.model_copy(
        update={"db_schema": names.schema, "table": names.table, "channel": names.channel}
    )


async def for_outboxes(
    connect: Connect,
    settings: DatabaseSettings,
    all_schemas: bool,
    one: OneOutbox,
    *,
    schemas: str | None = None,
) -> int:
    """Run ``one`` on the configured outbox, or with ``all_schemas`` on every migrated outbox
    of the database whose table has the configured name (each line of output then starts
    with ``schema.table:``), and on that table in every schema matching the LIKE pattern
    ``schemas`` (``migrate``: new tenants): the exit code of failure if it failed for any (the
    others done all the same), else the highest of theirs."""
    conn = await connect(settings)
    try:
        if not all_schemas:
            return await one(conn, settings.names)
        names = settings.names
        found = [f.names for f in await discover_outboxes(conn, table=names.table)]
        if schemas is not None:
            known = {n.schema for n in found}
            found += [
                OutboxNames(schema, names.table, names.channel)
                for schema in await schemas_like(conn, schemas)
                if schema not in known
            ]
            found.sort(key=lambda n: n.target)
        if not found:
            print(
                f"no migrated outbox table named {settings.names.table!r} in this database "
                "(a new schema's outbox is migrated with `notify-outbox migrate --schema S`)",
                file=sys.stderr,
            )
            return EXIT_OK
        worst, failed = EXIT_OK, 0
        for outbox in found:
            target = outbox.target
            try:
                with (
                    contextlib.redirect_stdout(_Prefixed(sys.stdout, f"{target}: ")),
                    contextlib.redirect_stderr(_Prefixed(sys.stderr, f"{target}: ")),
                ):
                    worst = max(worst, await one(conn, outbox))
            except (MigrationError, NotifyOutboxError, asyncpg.PostgresError) as e:
                # One tenant's failure does not keep the command from the others.
                failed += 1
                print(f"{target}: {type(e).__name__}: {e}", file=sys.stderr)
        if failed:
            print(f"notify-outbox: failed for {failed} of {len(found)} outboxes", file=sys.stderr)
            return EXIT_FAILED
        return worst
    finally:
        await conn.close()


class _Prefixed(io.TextIOBase):
    """A text stream that writes each line to ``out`` after ``prefix``."""

    def __init__(self, out: TextIO, prefix: str) -> None:
        self._out = out
        self._prefix = prefix
        self._at_start = True

    def write(self, text: str) -> int:
        for line in text.splitlines(keepends=True):
            if self._at_start:
                self._out.write(self._prefix)
            self._out.write(line)
            self._at_start = line.endswith("\n")
        return len(text)
