"""The test PgBouncer pools as configured, and as people deploy it.

These tests document the hazards of transaction pooling that the relay must
handle (session state that does not stick and leaks to other clients, asyncpg's
named prepared statements, LISTEN), prove the pooler rejects startup
parameters it does not know, as a stock deployment does, and reproduce the
crash of Debian's PgBouncer 1.18 on a cancel request cut short.
"""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import anyio
import asyncpg
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

import devstack.pgbouncer
from devstack import PgBouncer, StackError
from devstack._common import tail
from tests.pooling import Poolers
from tests.support import dsn_with_user

if TYPE_CHECKING:
    from tests.conftest import Services

pytestmark = pytest.mark.anyio

# Each holder keeps one server connection; the pool has 20.
MAX_HOLDERS = 19
WAIT_S = 10.0
REPO_ROOT = Path(__file__).resolve().parents[2]


async def _connect(dsn: str, **kwargs: Any) -> asyncpg.Connection:
    # No named prepared statements: they do not survive transaction pooling.
    kwargs.setdefault("statement_cache_size", 0)
    return await asyncpg.connect(dsn, **kwargs)


@asynccontextmanager
async def _backend_held(dsn: str, pid: int) -> AsyncIterator[asyncpg.Connection]:
    """Open transactions through the pooler until one of them runs on backend ``pid``.

    An idle server connection is handed out before a new one is opened, so the
    first or second holder normally gets it; yields the holder in its transaction.
    """
    async with AsyncExitStack() as stack:
        for _ in range(MAX_HOLDERS):
            conn = await _connect(dsn)
            stack.push_async_callback(conn.close)
            await conn.execute("BEGIN")
            if await conn.fetchval("SELECT pg_backend_pid()") == pid:
                yield conn
                await conn.execute("ROLLBACK")
                return
        pytest.fail(f"{MAX_HOLDERS} transactions through the pooler never got backend {pid}")


async def test_transaction_mode_session_state_neither_sticks_nor_stays_private(
    poolers: Poolers, db_dsn: str
) -> None:
    dsn = poolers.dsn_through("transaction", db_dsn)
    client = await _connect(dsn)
    try:
        first_pid = await client.fetchval(
            "SELECT pg_backend_pid() FROM set_config('statement_timeout', '4321', false)"
        )
        async with _backend_held(dsn, first_pid) as other_client:
            # The client's SET went to a server connection that now serves someone else...
            assert await other_client.fetchval("SHOW statement_timeout") == "4321ms"
            # ...and its next statement runs on another backend, without it.
            pid, timeout = await client.fetchrow(
                "SELECT pg_backend_pid(), current_setting('statement_timeout')"
            )
            assert pid != first_pid
            assert timeout == "0"
    finally:
        await client.close()


async def test_session_mode_keeps_one_backend_per_client(poolers: Poolers, db_dsn: str) -> None:
    dsn = poolers.dsn_through("session", db_dsn)
    client = await _connect(dsn)
    others: list[asyncpg.Connection] = []
    try:
        pid = await client.fetchval(
            "SELECT pg_backend_pid() FROM set_config('statement_timeout', '4321', false)"
        )
        for _ in range(3):
            other = await _connect(dsn)
            others.append(other)
            await other.execute("BEGIN")
            assert await other.fetchval("SELECT pg_backend_pid()") != pid
            assert await other.fetchval("SHOW statement_timeout") == "0"
        for _ in range(3):
            async with client.transaction():
                assert await client.fetchval("SELECT pg_backend_pid()") == pid
        assert await client.fetchval("SHOW statement_timeout") == "4321ms"
    finally:
        for conn in (client, *others):
            await conn.close()


async def test_transaction_mode_breaks_asyncpg_statement_cache(
    poolers: Poolers, db_dsn: str
) -> None:
    dsn = poolers.dsn_through("transaction", db_dsn)
    query = "SELECT pg_backend_pid() + $1::int"
    cached = await asyncpg.connect(dsn)  # asyncpg's default: named, cached statements
    uncached = await _connect(dsn)
    try:
        pid = await cached.fetchval(query, 0)
        async with _backend_held(dsn, pid):
            # The statement was prepared on a backend another client now holds.
            with pytest.raises(asyncpg.InvalidSQLStatementNameError, match="does not exist"):
                await cached.fetchval(query, 0)
        pid = await uncached.fetchval(query, 0)
        async with _backend_held(dsn, pid):
            assert await uncached.fetchval(query, 0) != pid
    finally:
        await cached.close()
        await uncached.close()


@pytest.mark.parametrize("mode", ["transaction", "session"])
async def test_listen_through_the_pooler(poolers: Poolers, db_dsn: str, mode: str) -> None:
    channel = f"h_{uuid.uuid4().hex[:12]}"
    received: dict[str, anyio.Event] = {"direct": anyio.Event(), "pooled": anyio.Event()}
    direct = await _connect(db_dsn)
    pooled = await _connect(poolers.dsn_through(mode, db_dsn))
    sender = await _connect(db_dsn)
    try:
        await direct.add_listener(channel, lambda *_: received["direct"].set())
        await pooled.add_listener(channel, lambda *_: received["pooled"].set())
        await sender.execute(f"NOTIFY {channel}, 'hello'")
        with anyio.fail_after(WAIT_S):
            await received["direct"].wait()
        if mode == "session":
            with anyio.fail_after(WAIT_S):
                await received["pooled"].wait()
        else:
            # The LISTEN ran on a server connection the client gave back: the
            # notification reached a backend that no client is linked to. Anything the
            # pooler had forwarded to this client comes before the answer to its next
            # statement (one socket, in order), and asyncpg dispatches it on reading:
            # after a few round trips (each may be linked to another server connection,
            # the LISTEN's among them) the listener would have been called.
            for _ in range(3):
                assert await pooled.fetchval("SELECT 1") == 1
            assert not received["pooled"].is_set()
    finally:
        for conn in (direct, pooled, sender):
            await conn.close()


@pytest.mark.parametrize("mode", ["transaction", "session"])
async def test_configured_as_deployed(poolers: Poolers, db_dsn: str, mode: str) -> None:
    dsn = poolers.dsn_through(mode, db_dsn)
    # application_name is one of the parameters PgBouncer tracks itself.
    conn = await _connect(dsn, server_settings={"application_name": "pooled-client"})
    try:
        assert await conn.fetchval("SELECT current_setting('application_name')") == (
            "pooled-client"
        )
    finally:
        await conn.close()
    with pytest.raises(
        asyncpg.ProtocolViolationError,
        match="unsupported startup parameter: idle_in_transaction_session_timeout",
    ):
        await _connect(dsn, server_settings={"idle_in_transaction_session_timeout": "1000"})
    # extra_float_digits is the one parameter on the ignore list.
    conn = await _connect(dsn, server_settings={"extra_float_digits": "3"})
    await conn.close()

    config = {row["key"]: row["value"] for row in poolers.pooler(mode).admin("SHOW CONFIG")}
    assert config["pool_mode"] == mode
    assert config["ignore_startup_parameters"] == "extra_float_digits"
    assert config["auth_type"] == "trust"
    assert config["max_client_conn"] == "200"
    assert config["default_pool_size"] == "20"
    assert config["server_reset_query"] == "DISCARD ALL"


async def test_pooled_dsn_reaches_the_tests_database(pooled_dsn: str, db_dsn: str) -> None:
    conn = await _connect(pooled_dsn)
    try:
        assert await conn.fetchval("SELECT current_database()") == db_dsn.rsplit("/", 1)[1]
        assert await conn.fetchval("SELECT count(*) FROM outbox") == 0
    finally:
        await conn.close()


@pytest.fixture
def password_role(services: Services) -> Iterator[tuple[str, str]]:
    """A login role that PostgreSQL asks a password of (scram over TCP)."""
    name, password = f"r_{uuid.uuid4().hex[:12]}", uuid.uuid4().hex

    async def run(sql: str) -> None:
        conn = await asyncpg.connect(services.dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    anyio.run(run, f"CREATE ROLE {name} LOGIN PASSWORD '{password}'")
    yield name, password
    anyio.run(run, f"DROP ROLE IF EXISTS {name}")


@pytest.mark.parametrize("mode", ["transaction", "session"])
async def test_dsn_through_lets_a_password_role_in(
    poolers: Poolers, db_dsn: str, password_role: tuple[str, str], mode: str
) -> None:
    name, password = password_role
    dsn = poolers.dsn_through(mode, dsn_with_user(db_dsn, name, password))
    conn = await _connect(dsn)
    try:
        assert await conn.fetchval("SELECT current_user") == name
    finally:
        await conn.close()


def test_start_fails_with_the_log_tail_when_the_port_is_taken(
    poolers: Poolers, tmp_path: Path
) -> None:
    taken = poolers.session.port
    pooler = PgBouncer(
        tmp_path / "pgbouncer",
        postgres_port=poolers.session.postgres_port,
        port=taken,
    )
    with pytest.raises(StackError, match=r"exited with code \d+ while starting") as info:
        pooler.start()
    assert "Address already in use" in str(info.value)
    assert not pooler.is_running
    assert poolers.session.is_running


def test_stop_and_start_again_on_the_same_port(poolers: Poolers, tmp_path: Path) -> None:
    pooler = PgBouncer(tmp_path / "pgbouncer", postgres_port=poolers.session.postgres_port)
    pooler.start()
    try:
        pid = pooler.pid
        assert pooler.is_running
        assert pid is not None
        # Another handle on the same directory controls the same process.
        again = PgBouncer(tmp_path / "pgbouncer", postgres_port=pooler.postgres_port)
        assert again.port == pooler.port
        assert again.pid == pid
        again.stop()
        assert not pooler.is_running
        pooler.start()
        assert pooler.pid not in (None, pid)
        assert pooler.admin("SHOW VERSION")[0]["version"].startswith("PgBouncer")
    finally:
        pooler.stop()


def test_missing_binary_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devstack.pgbouncer, "find_pgbouncer", lambda: None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # not root: no apt-get
    with pytest.raises(StackError) as info:
        devstack.pgbouncer.ensure_pgbouncer()
    assert devstack.pgbouncer.INSTALL_COMMAND in str(info.value)


def test_cli_up_with_pgbouncer_exports_both_poolers(tmp_path: Path) -> None:
    directory = tmp_path / "cli"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "devstack", *args, "--dir", str(directory)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    async def server_port_through(dsn: str) -> int:
        conn = await _connect(dsn)
        try:
            return int(await conn.fetchval("SELECT current_setting('port')"))
        finally:
            await conn.close()

    up = cli("up", "--fast", "--pgbouncer")
    try:
        assert up.returncode == 0, up.stderr
        exports = dict(
            line.removeprefix("export ").split("=", 1) for line in up.stdout.splitlines()
        )
        postgres_port = int(exports["NOTIFY_OUTBOX_TEST_DSN"].rsplit(":", 1)[1].split("/")[0])
        for mode, key in (
            ("transaction", "NOTIFY_OUTBOX_TEST_PGBOUNCER_TX_DSN"),
            ("session", "NOTIFY_OUTBOX_TEST_PGBOUNCER_SESSION_DSN"),
        ):
            assert anyio.run(server_port_through, exports[key]) == postgres_port
            pooler = PgBouncer(directory / "pgbouncer" / mode, postgres_port=postgres_port)
            assert pooler.is_running
            assert pooler.admin("SHOW CONFIG") != []
        status = cli("status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert "pgb-tx" in status.stdout
        assert "pgb-sess" in status.stdout
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert not PgBouncer(directory / "pgbouncer" / "session", postgres_port=1).is_running
    assert "NOTIFY_OUTBOX_TEST_PGBOUNCER_TX_DSN" not in cli("env").stdout


async def test_a_crashed_pooler_is_reported_and_restarted(poolers: Poolers, db_dsn: str) -> None:
    pooler = poolers.session
    port, pid = pooler.port, pooler.pid
    assert pid is not None
    pooler.kill()  # gone without stop(), as after a FATAL exit
    crashes = poolers.restart_crashed()
    assert len(crashes) == 1
    assert "session pooling" in crashes[0]
    assert str(pooler.log_path) in crashes[0]
    assert pooler.port == port
    assert pooler.pid not in (None, pid)
    conn = await _connect(poolers.dsn_through("session", db_dsn))
    try:
        assert await conn.fetchval("SELECT 1") == 1
    finally:
        await conn.close()


async def _message(stream: BufferedByteReceiveStream) -> tuple[bytes, bytes]:
    kind = await stream.receive_exactly(1)
    (size,) = struct.unpack("!i", await stream.receive_exactly(4))
    return kind, await stream.receive_exactly(size - 4)


async def _cancel_cut_short(pooler: PgBouncer, direct: asyncpg.Connection) -> None:
    """One client runs pg_sleep; another sends its CancelRequest and hangs up at once.

    Raw protocol, because that is the whole point: libpq waits for the server to close a
    cancel connection; asyncpg does too, unless its cancel task is itself cancelled (by
    terminate(), close() or a command timeout of the cancelled connection).
    """
    name = f"cancel-{uuid.uuid4().hex[:8]}"
    async with await anyio.connect_tcp("127.0.0.1", pooler.port) as client:
        params = f"user\0{pooler.admin_user}\0database\0postgres\0application_name\0{name}\0\0"
        startup = struct.pack("!i", 196608) + params.encode()
        await client.send(struct.pack("!i", 4 + len(startup)) + startup)
        reader = BufferedByteReceiveStream(client)
        key = b""
        while (message := await _message(reader))[0] != b"Z":
            if message[0] == b"K":
                key = message[1]  # BackendKeyData: the (PgBouncer-issued) pid and secret
        query = b"SELECT pg_sleep(30)\0"
        await client.send(b"Q" + struct.pack("!i", 4 + len(query)) + query)
        with anyio.fail_after(WAIT_S):
            # Until the server runs it, seen from a direct connection: only then does
            # PgBouncer pass a cancel request on to PostgreSQL.
            while not await direct.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name = $1 AND state = 'active'",
                name,
            ):
                if not pooler.is_running:  # the previous hang-up took it down
                    return
        async with await anyio.connect_tcp("127.0.0.1", pooler.port) as canceller:
            await canceller.send(struct.pack("!ii", 16, 80877102) + key)


def _version(pooler: PgBouncer) -> tuple[int, ...]:
    text = pooler.admin("SHOW VERSION")[0]["version"]  # "PgBouncer 1.18.0"
    return tuple(int(part) for part in text.split()[1].split("."))


async def test_pgbouncer_before_1_19_1_dies_of_a_cancel_request_cut_short(
    tmp_path: Path, services: Services
) -> None:
    """PgBouncer 1.18 (Debian bookworm's) exits with "FATAL ... disconnect_client(): bad
    client state: 0" when a client closes a cancel request's connection before PgBouncer
    has passed the request on (pgbouncer issue #801, fixed in 1.19.1 by #846): every client
    of the pooler loses its connection. With a newer PgBouncer this test expects it to
    survive, so it keeps telling which kind the stack runs."""
    postgres = urlsplit(services.dsn)
    pooler = PgBouncer(
        tmp_path / "pgbouncer",
        postgres_host=postgres.hostname or "127.0.0.1",
        postgres_port=postgres.port or 5432,
        users={unquote(postgres.username or "postgres"): unquote(postgres.password or "")},
    )
    pooler.start()
    direct = await _connect(services.dsn)
    try:
        affected = _version(pooler) < (1, 19, 1)
        for _ in range(50):
            # It dies a moment after a hang-up, so the next login may be refused (anyio's
            # connect_tcp reports a refused connection as a plain OSError).
            with contextlib.suppress(OSError, anyio.EndOfStream, anyio.BrokenResourceError):
                await _cancel_cut_short(pooler, direct)
            if not pooler.is_running:
                break
        if affected:
            assert not pooler.is_running, "PgBouncer < 1.19.1 survived 50 cut-short cancels"
            assert "bad client state" in tail(pooler.log_path)
        else:
            assert pooler.is_running, tail(pooler.log_path)
    finally:
        await direct.close()
        pooler.stop()
