"""The bench's PgBouncer: one transaction-pooling instance in front of the run's PostgreSQL,
started only when a selected mode runs through it (``Mode.pgbouncer``), so that the cost of
the pooler can be measured against the same relay connecting directly.

Only the mode's own process goes through it: the database set-up, the load generator, the
consumer and every check of the bench connect directly, as before.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from bench.config import Mode
from bench.procs import BenchError
from bench.services import Services
from devstack._common import StackError
from devstack.pgbouncer import PgBouncer, ensure_pgbouncer

_VERSION_TIMEOUT = 10.0


def pgbouncer_version(binary: Path) -> str:
    """The first line of ``pgbouncer --version`` (e.g. ``PgBouncer 1.18.0``)."""
    try:
        done = subprocess.run(
            [str(binary), "--version"],
            capture_output=True,
            text=True,
            timeout=_VERSION_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({type(e).__name__}: {e})"
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[0] if lines else f"unknown (exit {done.returncode}, no output)"


def _start(services: Services) -> dict[str, Any]:
    parts = urlsplit(services.dsn)
    if not parts.hostname:
        raise BenchError("the bench's DSN has no host; a PgBouncer in front of it needs one")
    user = unquote(parts.username) if parts.username else "postgres"
    password = unquote(parts.password) if parts.password is not None else None
    try:
        binary = ensure_pgbouncer()
        pooler = PgBouncer(
            services.work_dir / "pgbouncer",
            postgres_host=parts.hostname,
            postgres_port=parts.port or 5432,
            pool_mode="transaction",
            # The bench's own role logs in through it (its password goes to the auth_file).
            users={user: password},
        )
        pooler.start()
    except StackError as e:
        raise BenchError(f"could not start PgBouncer for the pooled modes: {e}") from e
    services.pgbouncer = pooler
    config = pooler.config()
    return {
        "ran": True,
        "version": pgbouncer_version(binary),
        "binary": str(binary),
        "pool_mode": pooler.pool_mode,
        "port": pooler.port,
        "pid": pooler.pid,
        "settings": {
            k: config[k]
            for k in (
                "pool_mode",
                "max_client_conn",
                "default_pool_size",
                "ignore_startup_parameters",
            )
            if k in config
        },
    }


async def start_pgbouncer(services: Services) -> dict[str, Any]:
    """Start the run's transaction-pooling PgBouncer (``services.pgbouncer``); returns
    the environment record (version, pool mode, settings)."""
    return await asyncio.to_thread(_start, services)


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command: state is field 3 of stat(5), utime 14 and stime 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _end_record(pooler: PgBouncer) -> dict[str, Any]:
    pid = pooler.pid
    out: dict[str, Any] = {"running_at_end": pid is not None}
    if pid is None:
        return out
    # Its own CPU is no part of the mode's process CPU (mode_cpu_us_per_event): the pooler's
    # share of the cost, for the whole run.
    out["cpu_s"] = _cpu_seconds(pid)
    try:
        rows = pooler.admin("SHOW STATS")
    except StackError as e:  # the record is optional; never fail a run for it
        out["stats_error"] = str(e)
        return out
    out["stats"] = {
        r["database"]: {
            "transactions": int(r["total_xact_count"]),
            "queries": int(r["total_query_count"]),
        }
        for r in rows
        if r.get("database") != "pgbouncer"
    }
    return out


async def end_record(services: Services) -> dict[str, Any]:
    """At the run's end: whether PgBouncer still ran (1.18 can die on its own, pgbouncer
    issue #801) and its ``SHOW STATS`` per database (the pooled traffic went through it)."""
    pooler = services.pgbouncer
    if not isinstance(pooler, PgBouncer):
        return {}
    return await asyncio.to_thread(_end_record, pooler)


def needs_pgbouncer(modes: Iterable[Mode]) -> bool:
    """Whether any of ``modes`` runs through the run's PgBouncer."""
    return any(m.pgbouncer for m in modes)


def _through(pooler: PgBouncer, dsn: str) -> str:
    """``dsn`` (database, user, options kept) with its host and port those of ``pooler``."""
    parts = urlsplit(dsn)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"127.0.0.1:{pooler.port}"
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{netloc}" if userinfo else netloc))


def mode_dsns(services: Services, mode: Mode, dsn: str) -> dict[str, str]:
    """``NOTIFY_OUTBOX_DSN`` of a process of ``mode`` (through PgBouncer for a pooled mode),
    and ``NOTIFY_OUTBOX_LISTEN_DSN`` direct when a pooled mode listens."""
    if not mode.pgbouncer:
        return {"NOTIFY_OUTBOX_DSN": dsn}
    pooler = services.pgbouncer
    if not isinstance(pooler, PgBouncer):
        raise BenchError(f"mode {mode.name} runs through PgBouncer, but the run started none")
    out = {"NOTIFY_OUTBOX_DSN": _through(pooler, dsn)}
    if mode.listen_direct:
        out["NOTIFY_OUTBOX_LISTEN_DSN"] = dsn
    return out
