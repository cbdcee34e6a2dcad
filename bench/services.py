"""PostgreSQL and Kafka for a run: the bench's own devstack ``Stack`` (durable commits), or
the services named by ``NOTIFY_OUTBOX_DSN`` / ``NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS`` (a
superuser DSN: the bench creates its own databases). Only loopback addresses are accepted.

Also the per-mode set-up: a fresh database migrated with ``python -m notify_outbox migrate``, a
fresh topic, and the NOTIFY trigger switched as a mode or variant asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient

from bench.config import Mode
from bench.procs import BenchError, Child, parent_pid
from devstack.relayproc import cli_argv, create_topics, relay_env

_ADMIN_TIMEOUT = 30.0
_MIGRATE_TIMEOUT = 120.0


@contextlib.asynccontextmanager
async def connection(dsn: str, *, within: float = 30.0, **kw: Any) -> AsyncIterator[Any]:
    """A connection to ``dsn`` (``asyncpg.connect`` keywords in ``kw``), closed (bounded) at the
    end."""
    conn = await asyncpg.connect(dsn, timeout=within, **kw)
    try:
        yield conn
    finally:
        await conn.close(timeout=5)


def dsn_for(dsn: str, database: str) -> str:
    """``dsn`` pointing at another database."""
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{database}"))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_loopback(dsn: str, bootstrap: str) -> None:
    """Refuse any PostgreSQL or Kafka address that is not on this host's loopback."""
    host = urlsplit(dsn).hostname or ""
    if not _is_loopback(host):
        raise BenchError(f"the bench only talks to loopback addresses; the DSN host is {host!r}")
    for server in bootstrap.split(","):
        h = server.strip().rsplit(":", 1)[0].strip("[]")
        if not _is_loopback(h):
            raise BenchError(
                f"the bench only talks to loopback addresses; a bootstrap server is {h!r}"
            )


@dataclass
class Services:
    """Where PostgreSQL and Kafka are, and what the bench created there."""

    dsn: str  # superuser, maintenance database
    bootstrap: str
    work_dir: Path
    own_stack: Any = None  # devstack.Stack when the bench started it
    kafka_version: str | None = None
    databases: list[str] = field(default_factory=list)
    src: Path | None = None  # the relay source snapshot: working directory of `migrate`
    pgbouncer: Any = None  # devstack PgBouncer in front of `dsn` (bench/pooler.py)

    async def admin(self, *statements: str, database: str | None = None) -> None:
        """Run statements on a fresh superuser connection."""
        dsn = dsn_for(self.dsn, database) if database else self.dsn
        async with connection(dsn, within=_ADMIN_TIMEOUT) as conn:
            for sql in statements:
                await conn.execute(sql, timeout=_ADMIN_TIMEOUT)

    async def create_database(self, name: str, *, src: Path | None = None) -> str:
        """Create an empty database, migrate it with the CLI (from the source tree ``src``,
        by default the run's snapshot: a relay from another tree may bring its own
        migrations); return its DSN."""
        await self.admin(
            f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', f'CREATE DATABASE "{name}"'
        )
        self.databases.append(name)
        dsn = dsn_for(self.dsn, name)
        child = await Child.start(
            f"migrate {name}",
            cli_argv("migrate"),
            env=relay_env(dsn),
            log_path=self.work_dir / "logs" / f"migrate-{name}.log",
            cwd=src or self.src,
        )
        code = await child.wait(_MIGRATE_TIMEOUT)
        if code != 0:
            await child.stop(5)
            raise BenchError(f"migrate of {name} failed ({code}):\n{child.tail()}")
        return dsn

    async def drop_database(self, name: str) -> None:
        """Drop one database this run created (and forget it)."""
        await self.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if name in self.databases:
            self.databases.remove(name)

    async def drop_databases(self) -> None:
        """Drop every database this run created (used with external services)."""
        for name in self.databases:
            with contextlib.suppress(OSError, asyncpg.PostgresError, TimeoutError):
                await self.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.databases.clear()

    async def broker_configs(self) -> dict[str, str]:
        """A few broker settings worth recording (empty if Kafka will not say)."""
        from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

        wanted = {
            "auto.create.topics.enable",
            "log.flush.interval.messages",
            "log.flush.interval.ms",
            "min.insync.replicas",
            "num.network.threads",
            "num.io.threads",
            "message.timestamp.type",
        }
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=10000)
        out: dict[str, str] = {}
        try:
            async with asyncio.timeout(_ADMIN_TIMEOUT):
                await admin.start()
                node = admin._client.cluster.brokers()
                broker_id = str(next(iter(node)).nodeId) if node else "1"
                res = await admin.describe_configs(
                    [ConfigResource(ConfigResourceType.BROKER, broker_id)]
                )
            for response in res:
                for resource in response.resources:
                    for entry in resource[4]:
                        if entry[0] in wanted:
                            out[entry[0]] = str(entry[1])
        except Exception as e:  # the record is optional; never fail a run for it
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            with contextlib.suppress(Exception):
                await admin.close()
        return out


# The plain poller's query, `WHERE published_at IS NULL ORDER BY id`, is served by this index
# in a polling outbox. notify-outbox's own schema (since migration 0003) indexes pending rows
# differently, so the baseline gets the index it would have, and is not measured handicapped.
POLLER_INDEX = (
    "CREATE INDEX IF NOT EXISTS poller_pending_idx ON outbox (id) WHERE published_at IS NULL"
)


async def prepare_poller(dsn: str) -> None:
    """Give the plain poller's database the index its claim needs (``POLLER_INDEX``)."""
    async with connection(dsn, within=_ADMIN_TIMEOUT) as conn:
        await conn.execute(POLLER_INDEX)


async def set_notify(dsn: str, notify: str) -> dict[str, Any]:
    """Switch the NOTIFY trigger of the outbox in ``dsn``: "shipped" leaves it, "disabled"
    disables every trigger on the table whose function calls ``pg_notify``, and any other value
    is written as migration 0002's ``notify_mode``. Returns what was done."""
    async with connection(dsn, within=_ADMIN_TIMEOUT) as conn:
        has_config = bool(
            await conn.fetchval("SELECT to_regclass('public.outbox_config') IS NOT NULL")
        )
        mode = await conn.fetchval("SELECT notify_mode FROM outbox_config") if has_config else None
        done: dict[str, Any] = {"notify": notify, "notify_mode_before": mode}
        if notify == "shipped":
            return done
        if notify == "disabled":
            names = await conn.fetch(
                """
                SELECT t.tgname FROM pg_trigger AS t JOIN pg_proc AS p ON p.oid = t.tgfoid
                WHERE t.tgrelid = 'public.outbox'::regclass AND NOT t.tgisinternal
                  AND p.prosrc LIKE '%pg_notify%'
                """
            )
            if not names:
                raise BenchError("no NOTIFY trigger found on the outbox table")
            for r in names:
                await conn.execute(f'ALTER TABLE outbox DISABLE TRIGGER "{r["tgname"]}"')
            done["disabled_triggers"] = [r["tgname"] for r in names]
            return done
        if not has_config:
            raise BenchError(
                f"notify mode {notify!r} needs migration 0002 (outbox_config), which this "
                "checkout does not have"
            )
        await conn.execute("UPDATE outbox_config SET notify_mode = $1", notify)
        done["notify_mode"] = notify
        return done


async def prepare_mode(
    services: Services, mode: Mode, database: str, topic: str, *, partitions: int
) -> tuple[str, dict[str, Any]]:
    """A fresh database for ``mode`` (migrated from the mode's own tree, if it has one), a
    fresh topic, the NOTIFY trigger as the mode wants it and, for the plain poller, the index
    its claim uses. Returns the DSN and what was done to the database (the Kafka floor has
    none: its DSN is empty)."""
    if mode.kind == "floor":
        await create_topics(services.bootstrap, [topic], partitions=partitions)
        return "", {"database": None}
    dsn = await services.create_database(database, src=Path(mode.cwd) if mode.cwd else None)
    await create_topics(services.bootstrap, [topic], partitions=partitions)
    setup = await set_notify(dsn, mode.notify)
    if mode.delivery != "at-least-once":
        async with connection(dsn, within=_ADMIN_TIMEOUT) as conn:
            await conn.execute("UPDATE outbox_config SET delivery = $1", mode.delivery)
        setup["delivery"] = mode.delivery
    if mode.kind == "poller":
        await prepare_poller(dsn)
        setup["poller_index"] = True
    return dsn, setup


async def db_counters(dsn: str, names: list[str], *, statements: bool) -> dict[str, Any]:
    """Per database of ``names``: transactions (``pg_stat_database`` commits + rollbacks)
    and, with ``statements``, statements (``pg_stat_statements`` calls), read through ``dsn``
    (the maintenance database, so that the reading itself counts in neither)."""
    async with connection(dsn, within=_ADMIN_TIMEOUT) as conn:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        rows = await conn.fetch(
            "SELECT datname, oid, xact_commit, xact_rollback FROM pg_stat_database "
            "JOIN pg_database USING (datname) WHERE datname = ANY($1::text[])",
            names,
        )
        out: dict[str, Any] = {
            r["datname"]: {
                "xacts": r["xact_commit"] + r["xact_rollback"],
                "commits": r["xact_commit"],
                "calls": None,
            }
            for r in rows
        }
        if statements:
            calls = await conn.fetch(
                "SELECT d.datname, sum(s.calls)::bigint AS calls FROM pg_stat_statements s "
                "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = ANY($1::text[]) "
                "GROUP BY d.datname",
                names,
            )
            for r in calls:
                out[r["datname"]]["calls"] = r["calls"]
            for name in out:
                if out[name]["calls"] is None:
                    out[name]["calls"] = 0
            # Entries evicted meanwhile (pg_stat_statements.max reached: a long-lived server
            # that ran many benches) take their calls with them: a window in which this moved
            # has no statement count (statements_delta).
            dealloc = await conn.fetchval("SELECT dealloc FROM pg_stat_statements_info")
            for name in out:
                out[name]["dealloc"] = dealloc
        return out


def statements_delta(before: dict[str, Any], after: dict[str, Any]) -> int | None:
    """Statements run between two ``db_counters`` readings of a database, or None when they
    were not counted or ``pg_stat_statements`` evicted entries meanwhile (a sum of calls that
    lost some would be too low, even negative)."""
    b, a = before.get("calls"), after.get("calls")
    if b is None or a is None or before.get("dealloc") != after.get("dealloc") or a < b:
        return None
    return int(a - b)


async def statement_calls(dsn: str, database: str) -> dict[int, tuple[str, int, int]]:
    """``pg_stat_statements`` of one database: query id -> (query text, calls, rows)."""
    async with connection(dsn, within=_ADMIN_TIMEOUT) as conn:
        rows = await conn.fetch(
            "SELECT s.queryid, s.query, s.calls, s.rows FROM pg_stat_statements s "
            "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = $1 AND s.queryid IS NOT NULL",
            database,
        )
    return {int(r["queryid"]): (r["query"], int(r["calls"]), int(r["rows"])) for r in rows}


async def postmaster_pid(dsn: str) -> int | None:
    """The pid of the PostgreSQL server's postmaster, when it runs on this host and its
    processes are visible here: the parent of this connection's backend."""
    async with connection(dsn, within=_ADMIN_TIMEOUT) as conn:
        backend = int(await conn.fetchval("SELECT pg_backend_pid()"))
        # The backend must still exist while its parent is read.
        parent = parent_pid(backend)
    return parent if parent is not None and parent > 1 else None


def _start_stack(base: Path) -> tuple[Any, str]:
    from devstack import KAFKA_VERSION, Stack

    stack = Stack(base, durable=True)
    stack.start()
    return stack, KAFKA_VERSION


async def open_services(work_dir: Path) -> Services:
    """The services of a run: from the environment when both variables are set, else a new
    devstack Stack (durable=True) under ``work_dir``."""
    dsn = os.environ.get("NOTIFY_OUTBOX_DSN")
    bootstrap = os.environ.get("NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS")
    if dsn and bootstrap:
        check_loopback(dsn, bootstrap)
        return Services(dsn, bootstrap, work_dir)
    stack, kafka_version = await asyncio.to_thread(_start_stack, work_dir / "stack")
    return Services(
        stack.postgres.dsn,
        stack.kafka.bootstrap_servers,
        work_dir,
        own_stack=stack,
        kafka_version=kafka_version,
    )


async def close_services(services: Services) -> None:
    """Stop the run's PgBouncer, then the own stack, or drop the databases created on
    external services."""
    if services.pgbouncer is not None:
        pooler, services.pgbouncer = services.pgbouncer, None
        await asyncio.to_thread(pooler.stop)
    if services.own_stack is not None:
        await asyncio.to_thread(services.own_stack.stop)
    else:
        await services.drop_databases()


def make_work_dir() -> Path:
    """A new temporary directory for the run (stack, logs, per-event arrays)."""
    return Path(tempfile.mkdtemp(prefix="notify-outbox-bench-"))


def remove_work_dir(path: Path) -> None:
    """Remove a directory made by ``make_work_dir``."""
    if path.name.startswith("notify-outbox-bench-"):
        shutil.rmtree(path, ignore_errors=True)
