"""The outbox's migrations from an Alembic revision (extra: ``alembic``).

One line in a revision of your own applies the outbox's pending migrations, in the revision's
transaction, with the same runner, tracking table and lock as ``notify-outbox migrate``::

    from alembic import op
    from notify_outbox.alembic import upgrade_outbox

    def upgrade() -> None:
        upgrade_outbox(op, up_to=6)

It works under asyncpg (an async engine whose ``env.py`` runs the migrations through
``connection.run_sync``) as under psycopg or psycopg2. The outbox's migrations are scripts of
many statements, which asyncpg refuses as prepared statements (``exec_driver_sql`` and
``op.execute`` prepare them): under asyncpg the helper hands them to the driver's own
connection, whose ``execute()`` without arguments uses PostgreSQL's simple query protocol.

``include_object`` keeps Alembic's autogenerate from proposing to drop the outbox's tables
(or see ``notify_outbox.sqlalchemy.outbox_tables`` for ``Table`` objects of them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from alembic.operations import Operations
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.util import await_only

from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.names import OutboxNames
from notify_outbox.pg.db import MIN_SERVER_VERSION
from notify_outbox.pg.migrations import _TRACKING, OUTBOX_TRACK, _checksum, migrate
from notify_outbox.pg.sqlfiles import render

__all__ = ["include_object", "migrate_connection", "outbox_table_names", "upgrade_outbox"]

IncludeObject = Callable[[Any, str | None, str, bool, Any], bool]


def upgrade_outbox(
    op: Operations, names: OutboxNames | None = None, *, up_to: int | None = None
) -> list[int]:
    """Apply the outbox's pending migrations (up to version ``up_to``) in the transaction of
    the Alembic revision that calls it; returns the versions applied.

    Idempotent: what the database has (from an earlier revision, or ``notify-outbox
    migrate``) is skipped, so running it twice applies nothing the second time. Give
    ``up_to`` the newest version you mean (the files of ``sql/migrations``; ``notify-outbox
    verify`` lists what a database has and lacks): a revision then does the same on every
    database, and a later release's migrations come in a revision of their own.

    Needs a database connection: not for ``alembic upgrade --sql`` (print the SQL with
    ``notify-outbox sql`` instead).
    """
    context = op.get_context()
    if context.as_sql:
        raise ConfigurationError(
            "upgrade_outbox needs a database connection; for `alembic upgrade --sql`, print "
            "the outbox's SQL with `notify-outbox sql` (or render_migrations()) instead"
        )
    return migrate_connection(op.get_bind(), names, up_to=up_to)


def migrate_connection(
    connection: Connection, names: OutboxNames | None = None, *, up_to: int | None = None
) -> list[int]:
    """``notify_outbox.migrate`` on a SQLAlchemy ``Connection`` (asyncpg, psycopg or
    psycopg2), inside its current transaction; returns the versions applied.

    Under asyncpg it must run where SQLAlchemy can wait for the driver: inside
    ``AsyncConnection.run_sync`` (Alembic's async ``env.py`` template does that).
    """
    names = names or OutboxNames()
    driver = connection.dialect.driver
    if connection.dialect.name != "postgresql":
        raise ConfigurationError(
            f"notify-outbox needs PostgreSQL, not {connection.dialect.name} ({driver})"
        )
    if driver == "asyncpg":
        # A statement through SQLAlchemy first: its asyncpg adapter opens the transaction
        # lazily, and the migrations must run inside it (as a savepoint of it).
        connection.exec_driver_sql("SELECT 1")
        raw = connection.connection.driver_connection
        applied: list[int] = await_only(migrate(raw, names, up_to=up_to))
        return applied
    return _migrate_sync(connection, names, up_to)


def _migrate_sync(connection: Connection, names: OutboxNames, up_to: int | None) -> list[int]:
    """``migrate_track`` for a synchronous driver (psycopg, psycopg2): the same steps."""
    version = int(
        connection.exec_driver_sql("SELECT current_setting('server_version_num')").scalar_one()
    )
    if version < MIN_SERVER_VERSION:
        raise ConfigurationError(
            f"PostgreSQL {version // 10000} is not supported: notify-outbox needs PostgreSQL 14 "
            "or newer"
        )
    # Scripts go to the driver as they are: no parameters, so no placeholder is looked for
    # (the SQL holds '%' operators), and several statements are allowed.
    script = {"no_parameters": True}
    applied = []
    with connection.begin_nested():
        connection.execute(
            text("SELECT pg_advisory_xact_lock(CAST(:key AS bigint))"),
            {"key": names.lock_namespace},
        )
        connection.exec_driver_sql(render(_TRACKING, names), execution_options=script)
        table = render("@migrations@", names)
        done = set(
            connection.execute(
                text(f"SELECT version FROM {table} WHERE target = :target"),
                {"target": names.target},
            ).scalars()
        )
        for m in OUTBOX_TRACK.migrations():
            if m.version in done or (up_to is not None and m.version > up_to):
                continue
            connection.exec_driver_sql(m.render(names), execution_options=script)
            connection.execute(
                text(
                    f"INSERT INTO {table} (target, version, name, checksum) "
                    "VALUES (:target, :version, :name, :checksum)"
                ),
                {
                    "target": names.target,
                    "version": m.version,
                    "name": m.name,
                    "checksum": _checksum(m),
                },
            )
            applied.append(m.version)
    return applied


def outbox_table_names(names: OutboxNames | None = None) -> frozenset[tuple[str, str]]:
    """The tables the outbox's migrations create, as (schema, table): the outbox, its dead
    letters, its config row, the exactly-once mode's slots and stamps, and the migrations'
    tracking table."""
    names = names or OutboxNames()
    t = names.table
    tables = (
        t,
        f"{t}_dead_letter",
        f"{t}_config",
        f"{t}_eos_slot",
        f"{t}_eos_stamp",
        "notify_outbox_migrations",
    )
    return frozenset((names.schema, table) for table in tables)


def include_object(
    *outboxes: OutboxNames, default_schema: str = "public", chain: IncludeObject | None = None
) -> IncludeObject:
    """An ``include_object`` hook for Alembic's ``context.configure`` that leaves the
    outboxes' tables (the default outbox when none is given) out of autogenerate, so that a
    revision never proposes to drop them::

        context.configure(..., include_object=include_object())

    ``default_schema``: the schema a table without one (``schema=None`` in Alembic's terms)
    lives in. ``chain``: a hook of your own, asked about everything else.
    """
    skip: set[tuple[str, str]] = set()
    for names in outboxes or (OutboxNames(),):
        skip |= outbox_table_names(names)

    def hook(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        if type_ == "table" and name is not None:
            schema = getattr(obj, "schema", None) or default_schema
            if (schema, name) in skip:
                return False
        if chain is not None:
            return chain(obj, name, type_, reflected, compare_to)
        return True

    return hook
