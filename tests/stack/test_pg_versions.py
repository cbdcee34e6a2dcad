"""The PostgreSQL versions the README claims: 14 and newer, tested on 14 and the newest 17.

PostgreSQL 15 is the one the rest of the suite runs on (Debian's package); the others
come from binary bundles on Maven Central (``NOTIFY_OUTBOX_PG_VERSION``, devstack/pgbundles.py).
The lower bound is real: the listener's ``end_old_listener`` query calls
``pg_terminate_backend(pid, timeout)``, which PostgreSQL 13 does not have.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import asyncpg
import pytest

from devstack import PostgresServer
from devstack.pgbundles import PG_VERSION_ENV
from devstack.relayproc import cli_argv, relay_env
from notify_outbox import OutboxNames
from notify_outbox.pg.sqlfiles import Queries

if TYPE_CHECKING:
    from tests.conftest import Services

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def start_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str], PostgresServer]]:
    """Start a throwaway server of a major version; all are stopped at the end."""
    servers: list[PostgresServer] = []

    def start(version: str) -> PostgresServer:
        monkeypatch.setenv(PG_VERSION_ENV, version)
        server = PostgresServer(tmp_path / f"pg{version}", durable=False)
        servers.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


async def _server_version_num(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SHOW server_version_num"))
    finally:
        await conn.close()


async def _end_old_listener(dsn: str) -> None:
    """The listener's query that needs 14+, on a session that does not exist."""
    conn = await asyncpg.connect(dsn)
    try:
        started = await conn.fetchval("SELECT now()")
        await conn.execute(Queries(OutboxNames())["end_old_listener"], 0, started, 5000)
    finally:
        await conn.close()


@pytest.mark.parametrize("version", ["14", "17", "18"])
def test_migration_tests_pass_on(
    version: str,
    start_server: Callable[[str], PostgresServer],
    services: Services,
    tmp_path: Path,
) -> None:
    server = start_server(version)
    assert anyio.run(_server_version_num, server.dsn) // 10000 == int(version)
    anyio.run(_end_old_listener, server.dsn)
    env = dict(os.environ)
    env.pop(PG_VERSION_ENV, None)
    env["NOTIFY_OUTBOX_TEST_DSN"] = server.dsn
    env["NOTIFY_OUTBOX_TEST_BOOTSTRAP_SERVERS"] = services.bootstrap
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            f"--basetemp={tmp_path / 'inner'}",
            "-q",
            "tests/integration/test_migrations.py",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


def test_postgres_13_lacks_what_the_listener_needs(
    start_server: Callable[[str], PostgresServer],
) -> None:
    server = start_server("13")
    assert anyio.run(_server_version_num, server.dsn) // 10000 == 13
    with pytest.raises(asyncpg.UndefinedFunctionError, match="pg_terminate_backend"):
        anyio.run(_end_old_listener, server.dsn)
    # So the relay and `migrate` refuse it at once, saying why (exit 2, one line).
    for command in ("migrate", "run"):
        result = subprocess.run(
            cli_argv(command),
            env=relay_env(server.dsn, "127.0.0.1:1"),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 2, result.stdout + result.stderr
        assert "PostgreSQL 13 is not supported" in result.stderr, result.stderr
