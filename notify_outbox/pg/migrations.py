"""Versioned schema migrations: apply them, check them, or print them for another tool."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import asyncpg

from notify_outbox.core.errors import MigrationError
from notify_outbox.core.names import OutboxNames

from .db import require_supported_server
from .sqlfiles import Migration, load_migrations, render

__all__ = [
    "OUTBOX_TRACK",
    "MigrationTrack",
    "TrackNames",
    "VerifyReport",
    "migrate",
    "migrate_track",
    "render_migrations",
    "render_track",
    "verify",
    "verify_track",
]

_TRACKING = """
CREATE SCHEMA IF NOT EXISTS @schema@;
CREATE TABLE IF NOT EXISTS @migrations@ (
    target     text        NOT NULL,
    version    integer     NOT NULL,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (target, version)
);
"""

log = logging.getLogger("notify_outbox.migrations")

#: What ``migrate`` NOTIFYs on a new outbox's channel (``relay/fleet.py`` re-discovers then).
REGISTRY_PAYLOAD = "notify-outbox:registry"  # the name it had before the move

# An attempt waits at most this long for each lock it needs (in PostgreSQL's lock_timeout
# syntax). A migration that takes a table lock queues every producer behind its request, so a
# long transaction on the table (a batch job, an idle session) must cost producers this much at
# most, not the whole transaction; and a deadlock with one must end with this migration giving
# up, which it does first: PostgreSQL looks for deadlocks after deadlock_timeout, 1 s.
LOCK_TIMEOUT = "500ms"
# How long `migrate` keeps trying (seconds) before it says which lock it could not get.
RETRY_FOR = 300.0

# Everything a migration defines, as (kind, name, definition) rows, for one schema. Compared
# between the real schema and a scratch copy built from the shipped migrations.
_CATALOG = """
WITH rels AS (
    SELECT c.oid, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = $1 AND c.relname = ANY($2::text[])
)
SELECT 'column' AS kind, r.relname || '.' || a.attname AS name,
       format_type(a.atttypid, a.atttypmod)
       || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
       || CASE a.attidentity WHEN 'd' THEN ' identity' WHEN 'a' THEN ' identity always'
          ELSE '' END
       || coalesce(' default ' || pg_get_expr(d.adbin, d.adrelid), '') AS definition
FROM rels r JOIN pg_attribute a ON a.attrelid = r.oid AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_attrdef d ON d.adrelid = r.oid AND d.adnum = a.attnum
UNION ALL
SELECT 'index', i.relname, pg_get_indexdef(i.oid)
FROM rels r JOIN pg_index x ON x.indrelid = r.oid JOIN pg_class i ON i.oid = x.indexrelid
UNION ALL
SELECT 'constraint', r.relname || '.' || c.conname, pg_get_constraintdef(c.oid)
FROM rels r JOIN pg_constraint c ON c.conrelid = r.oid
UNION ALL
SELECT 'trigger', t.tgname, pg_get_triggerdef(t.oid) || ' enabled=' || t.tgenabled::text
FROM rels r JOIN pg_trigger t ON t.tgrelid = r.oid AND NOT t.tgisinternal
UNION ALL
SELECT 'reloptions', r.relname, array_to_string(c.reloptions, ',')
FROM rels r JOIN pg_class c ON c.oid = r.oid
UNION ALL
SELECT 'function', p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')',
       p.prosrc || coalesce(' SET ' || array_to_string(p.proconfig, ', '), '')
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = $1 AND p.proname LIKE $3
"""


class TrackNames(Protocol):
    """The names one migration track is rendered with (``OutboxNames``, ``InboxNames``)."""

    @property
    def schema(self) -> str:
        """The schema holding the track's objects and its tracking table."""
        ...

    @property
    def table(self) -> str:
        """The track's main table, unqualified."""
        ...

    @property
    def target(self) -> str:
        """The track's key in the tracking table: unique per track and per table."""
        ...

    @property
    def lock_namespace(self) -> int:
        """The bigint advisory key that serializes concurrent ``migrate`` runs."""
        ...

    def substitutions(self) -> dict[str, str]:
        """Tokens of the SQL files mapped to their rendered text."""
        ...


N = TypeVar("N", bound=TrackNames)


@dataclass(frozen=True)
class MigrationTrack(Generic[N]):
    """An independent series of numbered migrations: the outbox's own, or the consumer-side
    inbox's. Each track has its folder under ``sql/`` and its rows in the tracking table
    (keyed by the names' ``target``), so tracks never see each other's versions."""

    folder: str
    # What to run when migrations are pending, for messages.
    command: str
    # The relations ``verify`` compares, from the main table's name.
    relations: Callable[[str], list[str]]
    # The same names in another schema: the scratch copy ``verify`` builds.
    in_schema: Callable[[N, str], N]
    # Tokens whose values must stay those of the real names in the scratch copy.
    schema_independent: tuple[str, ...] = ()

    def migrations(self) -> tuple[Migration, ...]:
        """The track's shipped migrations, in version order."""
        return load_migrations(self.folder)


OUTBOX_TRACK = MigrationTrack[OutboxNames](
    folder="migrations",
    command="notify-outbox migrate",
    relations=lambda t: [
        t,
        f"{t}_dead_letter",
        f"{t}_id_seq",
        f"{t}_config",
        f"{t}_eos_slot",
        f"{t}_eos_stamp",
    ],
    in_schema=lambda names, schema: dataclasses.replace(names, schema=schema),
    schema_independent=OutboxNames.SCHEMA_INDEPENDENT,
)


def _checksum(migration: Migration) -> str:
    return hashlib.sha256(migration.template.encode()).hexdigest()


def render_migrations(names: OutboxNames, *, since: int = 0) -> str:
    """All migrations after version ``since`` as one SQL script, for psql, Alembic or Flyway."""
    return render_track(OUTBOX_TRACK, names, since=since)


def render_track(track: MigrationTrack[N], names: N, *, since: int = 0) -> str:
    """``render_migrations`` for any track."""
    parts = []
    for m in track.migrations():
        if m.version > since:
            parts.append(f"-- notify-outbox migration {m.version:04d}_{m.name}\n")
            parts.append(m.render(names).rstrip() + "\n\n")
    return "".join(parts)


async def migrate(
    conn: asyncpg.Connection,
    names: OutboxNames,
    *,
    up_to: int | None = None,
    retry_for: float = RETRY_FOR,
) -> list[int]:
    """Apply the pending migrations for one outbox (up to version ``up_to``, if given) and
    return the versions applied.

    Safe to run from several processes at once: the whole run holds a transaction-scoped
    advisory lock, so the second process waits, then finds nothing left to do. Safe to run
    while producers and relays work: each attempt waits at most 0.5 s for any lock (producers
    queued behind a table lock wait no longer than that), and gives up and starts again, for
    ``retry_for`` seconds, when a lock is held longer or a deadlock is found. Then it raises
    MigrationError, naming the lock it could not get.
    """
    return await migrate_track(conn, OUTBOX_TRACK, names, up_to=up_to, retry_for=retry_for)


async def migrate_track(
    conn: asyncpg.Connection,
    track: MigrationTrack[N],
    names: N,
    *,
    up_to: int | None = None,
    retry_for: float = RETRY_FOR,
) -> list[int]:
    """``migrate`` for any track."""
    await require_supported_server(conn)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_for
    attempt = 0
    while True:
        attempt += 1
        try:
            return await _migrate_once(conn, track, names, up_to)
        except (asyncpg.LockNotAvailableError, asyncpg.DeadlockDetectedError) as e:
            what = "a deadlock" if isinstance(e, asyncpg.DeadlockDetectedError) else "a lock"
            if loop.time() >= deadline:
                raise MigrationError(
                    f"migrations of {names.target} not applied: for {retry_for:g} s "
                    f"({attempt} attempt{'s' * (attempt != 1)}) they met {what} they could "
                    f"not get past ({e}). "
                    "A long transaction on these tables (see pg_stat_activity, pg_locks) "
                    "holds what they need: end it, or run `notify-outbox migrate` again later"
                ) from None
            delay = min(0.05 * 2**attempt, 2.0) * random.uniform(0.5, 1.0)
            log.warning(
                "migrations of %s: attempt %d met %s (%s); nothing was applied, trying "
                "again in %.2f s",
                names.target,
                attempt,
                what,
                e,
                delay,
            )
            await asyncio.sleep(delay)


async def _migrate_once(
    conn: asyncpg.Connection, track: MigrationTrack[N], names: N, up_to: int | None
) -> list[int]:
    """One attempt, in one transaction: all pending migrations or none."""
    async with conn.transaction():
        # Taken before the lock timeout: a second `migrate` waits for the first to finish.
        await conn.execute("SELECT pg_advisory_xact_lock($1::bigint)", names.lock_namespace)
        was = await conn.fetchval("SELECT current_setting('lock_timeout')")
        await conn.execute("SELECT set_config('lock_timeout', $1, true)", LOCK_TIMEOUT)
        await conn.execute(render(_TRACKING, names))
        table = render("@migrations@", names)
        rows = await conn.fetch(f"SELECT version FROM {table} WHERE target = $1", names.target)
        done = {r["version"] for r in rows}
        applied = []
        for m in track.migrations():
            if m.version in done or (up_to is not None and m.version > up_to):
                continue
            await conn.execute(m.render(names))
            await conn.execute(
                f"INSERT INTO {table} (target, version, name, checksum) VALUES ($1, $2, $3, $4)",
                names.target,
                m.version,
                m.name,
                _checksum(m),
            )
            applied.append(m.version)
        channel = getattr(names, "channel", None)
        if applied and channel is not None:
            # A new or upgraded outbox: relays serving every outbox of the database (fleet.py)
            # hear it on its channel at commit and serve it (again) without waiting for their
            # next look at the catalog.
            await conn.execute("SELECT pg_notify($1, $2)", channel, REGISTRY_PAYLOAD)
        # Inside a caller's transaction (a savepoint here) the setting would outlive us.
        await conn.execute("SELECT set_config('lock_timeout', $1, true)", was)
    return applied


@dataclass
class VerifyReport:
    """What ``verify`` found; ``ok`` when the database matches the shipped migrations."""

    applied: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    changed: list[int] = field(default_factory=list)
    schema_differences: list[str] = field(default_factory=list)
    # Objects the migrations do not declare (an index a user added, say): reported, not failed.
    extras: list[str] = field(default_factory=list)
    # The command that applies the pending migrations (named in ``describe``).
    command: str = OUTBOX_TRACK.command

    @property
    def ok(self) -> bool:
        """True when every migration is applied, unchanged, and the schema is as declared."""
        return not (self.pending or self.changed or self.schema_differences)

    def describe(self) -> str:
        """A human-readable summary, one finding per line."""
        lines = [f"not declared by the migrations (left alone): {e}" for e in self.extras]
        if self.ok:
            lines.insert(0, f"up to date: migrations {self.applied} applied, schema matches")
            return "\n".join(lines)
        if self.pending:
            lines.append(f"pending migrations: {self.pending} (run `{self.command}`)")
        if self.changed:
            lines.append(f"applied migrations whose shipped SQL changed since: {self.changed}")
        lines.extend(f"schema differs: {d}" for d in self.schema_differences)
        return "\n".join(lines)


async def _catalog(
    conn: asyncpg.Connection, schema: str, table: str, relations: list[str]
) -> dict[str, str]:
    rows = await conn.fetch(_CATALOG, schema, relations, f"{table}\\_%")
    return {f"{r['kind']} {r['name']}": r["definition"] or "" for r in rows}


async def verify(conn: asyncpg.Connection, names: OutboxNames) -> VerifyReport:
    """Compare the database with the shipped migrations without changing anything.

    The expected schema is built by applying the migrations to a scratch schema inside a
    transaction that is always rolled back, so the comparison covers every column, index,
    constraint, trigger and function exactly as the migrations declare them.
    """
    return await verify_track(conn, OUTBOX_TRACK, names)


async def verify_track(
    conn: asyncpg.Connection, track: MigrationTrack[N], names: N
) -> VerifyReport:
    """``verify`` for any track."""
    report = VerifyReport(command=track.command)
    table = render("@migrations@", names)
    exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", table)
    recorded: dict[int, str] = {}
    if exists:
        rows = await conn.fetch(
            f"SELECT version, checksum FROM {table} WHERE target = $1", names.target
        )
        recorded = {r["version"]: r["checksum"] for r in rows}
    for m in track.migrations():
        if m.version not in recorded:
            report.pending.append(m.version)
        else:
            report.applied.append(m.version)
            if recorded[m.version] != _checksum(m):
                report.changed.append(m.version)
    if report.pending:
        return report

    scratch = track.in_schema(names, f"notify_outbox_verify_{secrets.token_hex(6)}")
    subs = scratch.substitutions()
    # Keep what does not depend on the schema's name identical to the real outbox.
    real = names.substitutions()
    for token in track.schema_independent:
        subs[token] = real[token]
    relations = track.relations(names.table)
    tx = conn.transaction()
    await tx.start()
    try:
        # With only pg_catalog on the search path every definition comes out schema-qualified,
        # so the real and the scratch schema print alike.
        await conn.execute("SET LOCAL search_path = pg_catalog")
        actual = await _catalog(conn, names.schema, names.table, relations)
        for m in track.migrations():
            text = m.template
            for token, value in subs.items():
                text = text.replace(token, value)
            await conn.execute(text)
        expected_raw = await _catalog(conn, scratch.schema, names.table, relations)
    finally:
        await tx.rollback()
    # PostgreSQL prints the scratch name bare and the real one quoted when it must be (a
    # reserved word such as "select"): map one onto the other as the server would print it.
    printed = await conn.fetchval("SELECT quote_ident($1)", names.schema)
    # Function bodies hold our own rendering, always quoted: map that form first.
    ours, theirs = f'"{scratch.schema}"', f'"{names.schema}"'
    expected = {
        k: v.replace(ours, theirs).replace(scratch.schema, printed) for k, v in expected_raw.items()
    }
    for key in sorted(expected.keys() | actual.keys()):
        if key not in actual:
            report.schema_differences.append(f"missing {key}")
        elif key not in expected:
            report.extras.append(key)
        elif expected[key] != actual[key]:
            if key.startswith("function "):
                report.schema_differences.append(f"{key}: body differs from the migrations")
            else:
                report.schema_differences.append(
                    f"{key}: expected {expected[key]!r}, found {actual[key]!r}"
                )
    return report
