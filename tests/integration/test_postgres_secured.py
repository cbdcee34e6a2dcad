"""The relay against a secured PostgreSQL (issue #33, part 1): TLS with ``sslmode=verify-full``
against a server certificate the test stack signs, SCRAM password authentication, and the relay
running as a least-privileged role that has exactly what ``notify-outbox sql --grants`` grants.
The migrations run as the schema's owner, the application inserts as a third role.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import asyncpg
import pytest

from notify_outbox import OutboxSettings, Relay
from tests.conftest import Services
from tests.faults.harness import eventually
from tests.support import RelayProcess, consume

pytestmark = pytest.mark.anyio

PASSWORDS = {"owner": "owner-pw-4f1c", "relay": "relay-pw-93ab", "app": "app-pw-0d7e"}


@dataclass(frozen=True)
class SecuredPostgres:
    port: int
    ca_file: Path  # signs the server's certificate
    other_ca_file: Path  # signs nothing this server shows
    superuser_dsn: str  # trusted, for the harness

    def dsn(self, role: str, *, ca: Path | None = None, password: str | None = None) -> str:
        """A ``verify-full`` DSN of the ``app`` database for ``role`` (SCRAM)."""
        secret = PASSWORDS[role] if password is None else password
        return (
            f"postgresql://{role}:{secret}@127.0.0.1:{self.port}/app"
            f"?sslmode=verify-full&sslrootcert={ca or self.ca_file}"
        )


def _owned_by_server(path: Path) -> None:
    """PostgreSQL refuses a key file others can read, or that is not its own user's."""
    path.chmod(0o600)
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(path, user.pw_uid, user.pw_gid)
        os.chown(path.parent, user.pw_uid, user.pw_gid)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "notify_outbox", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def secured_postgres(service_dir: Callable[[str], Path]) -> Iterator[SecuredPostgres]:
    """A PostgreSQL server of this module's own with TLS on (its certificate names 127.0.0.1
    and localhost), an ``app`` database migrated by its owner, and the relay and application
    roles granted what ``notify-outbox sql --grants`` prints."""
    from devstack import PostgresServer, StackError
    from devstack.certs import CertificateAuthority

    base = service_dir("pg-secured")
    ca = CertificateAuthority(base / "ca")
    other = CertificateAuthority(base / "other-ca", "a CA that signs nothing here")
    issued = ca.issue("postgres-server", hosts=["127.0.0.1", "localhost"])
    tls = base / "server-tls"
    tls.mkdir(exist_ok=True)
    cert, key = tls / "server.pem", tls / "server.key"
    shutil.copyfile(issued.cert_file, cert)
    shutil.copyfile(issued.key_file, key)
    _owned_by_server(key)
    cert.chmod(0o644)
    server = PostgresServer(
        base / "pg",
        durable=False,
        extra_conf={"ssl": "on", "ssl_cert_file": str(cert), "ssl_key_file": str(key)},
    )
    try:
        server.start()
    except StackError as e:
        pytest.fail(f"no PostgreSQL with TLS for the tests: {e}", pytrace=False)
    try:
        superuser = server.dsn_for("postgres")

        async def prepare() -> None:
            admin = await asyncpg.connect(superuser)
            try:
                for role, password in PASSWORDS.items():
                    await admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
                await admin.execute("CREATE DATABASE app OWNER owner")
                # A table of another concern in the same database: the relay must not see it.
                app = await asyncpg.connect(server.dsn_for("app"))
                try:
                    await app.execute("ALTER SCHEMA public OWNER TO owner")
                    await app.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                    await app.execute("SET ROLE owner; CREATE TABLE payroll (salary int)")
                finally:
                    await app.close()
            finally:
                await admin.close()

        anyio.run(prepare)
        owner = SecuredPostgres(server.port, ca.cert_file, other.cert_file, superuser).dsn("owner")
        migrated = _cli("migrate", env={"NOTIFY_OUTBOX_DSN": owner})
        assert migrated.returncode == 0, migrated.stderr
        grants = _cli("sql", "--grants", "--relay-role", "relay", "--app-role", "app", env={})
        assert grants.returncode == 0, grants.stderr

        async def grant() -> None:
            conn = await asyncpg.connect(owner)
            try:
                await conn.execute(grants.stdout)
            finally:
                await conn.close()

        anyio.run(grant)
        yield SecuredPostgres(server.port, ca.cert_file, other.cert_file, superuser)
    finally:
        server.stop(mode="immediate")


def relay_settings(pg: SecuredPostgres, services: Services, **kw: object) -> OutboxSettings:
    fields: dict[str, object] = {
        "dsn": pg.dsn("relay"),
        "kafka_bootstrap_servers": services.bootstrap,
        "workers": 2,
        "poll_interval": 30.0,  # long: delivery must come from the notifications
    }
    fields.update(kw)
    return OutboxSettings(**fields)  # type: ignore[arg-type]


async def test_a_least_privileged_relay_over_verified_tls_publishes_what_the_app_inserts(
    secured_postgres: SecuredPostgres, services: Services, topic: str
) -> None:
    """The relay connects as ``relay`` (SCRAM, ``sslmode=verify-full``), the application
    inserts as ``app``: every event arrives, each key's in order, and every session of the
    relay (workers, listener, pulse) is encrypted."""
    pg = secured_postgres
    app = await asyncpg.connect(pg.dsn("app"))
    admin = await asyncpg.connect(pg.superuser_dsn.rsplit("/", 1)[0] + "/app")
    try:
        with anyio.fail_after(60):
            async with Relay(relay_settings(pg, services)):
                for n in range(20):
                    await app.execute(
                        "INSERT INTO outbox (topic, key, payload) VALUES ($1, $2, $3)",
                        topic,
                        f"k{n % 4}",
                        f'{{"n": {n}}}',
                    )
                records, _ = await consume(services.bootstrap, topic, expect=20)
                sessions: list[asyncpg.Record] = []

                async def all_there() -> bool:
                    # The pulse opens its session from its own thread, beside the workers:
                    # on a busy host it can come after the events.
                    nonlocal sessions
                    sessions = await admin.fetch(
                        "SELECT a.application_name, s.ssl FROM pg_stat_activity a "
                        "JOIN pg_stat_ssl s USING (pid) WHERE a.usename = 'relay'"
                    )
                    names = {s["application_name"].split("/")[0] for s in sessions}
                    return {"notify-outbox-worker", "notify-outbox-pulse"} <= names

                await eventually(all_there, within=30, what="the relay's sessions are all open")
    finally:
        await app.close()
        await admin.close()
    by_key: dict[bytes | None, list[int]] = {}
    for r in records:
        assert r.value is not None
        by_key.setdefault(r.key, []).append(int(r.value.decode().split(":")[-1].strip(" }")))
    assert sum(len(v) for v in by_key.values()) == 20
    assert all(v == sorted(v) for v in by_key.values()), by_key
    names = {s["application_name"].split("/")[0] for s in sessions}
    assert {"notify-outbox-worker", "notify-outbox-pulse"} <= names, sessions
    assert len(sessions) >= 3, sessions  # workers, the listener, the pulse
    assert all(s["ssl"] for s in sessions), sessions


async def test_the_relay_and_app_roles_can_do_nothing_else(
    secured_postgres: SecuredPostgres,
) -> None:
    """What ``sql --grants`` grants, and no more: the relay role reads no other table, changes
    no setting of the outbox and creates nothing; the application role cannot read the
    outbox (other services' events)."""
    pg = secured_postgres
    relay = await asyncpg.connect(pg.dsn("relay"))
    app = await asyncpg.connect(pg.dsn("app"))
    try:
        denied = asyncpg.InsufficientPrivilegeError
        for statement in (
            "SELECT * FROM payroll",
            "INSERT INTO payroll VALUES (1)",
            "UPDATE outbox_config SET notify_mode = 'always'",
            "CREATE TABLE relay_was_here (x int)",
            "DROP TABLE outbox",
            "TRUNCATE outbox",
        ):
            with pytest.raises(denied):
                await relay.execute(statement)
        for statement in (
            "SELECT * FROM outbox",
            "DELETE FROM outbox",
            "SELECT * FROM outbox_dead_letter",
            "SELECT * FROM payroll",
        ):
            with pytest.raises(denied):
                await app.execute(statement)
        # What they may do (the relay's claim and marks run in the other test).
        assert await relay.fetchval("SELECT count(*) FROM outbox") >= 0
        assert await relay.fetchval("SELECT notify_mode FROM outbox_config") is not None
    finally:
        await relay.close()
        await app.close()


@pytest.mark.parametrize("case", ["wrong_password", "unknown_ca"])
async def test_a_relay_refused_by_postgres_says_why_and_exits(
    secured_postgres: SecuredPostgres, services: Services, case: str
) -> None:
    """A wrong password, or a CA that did not sign the server's certificate: the relay exits
    non-zero at start with an error that names the cause, and never the password."""
    pg = secured_postgres
    secret = "not-the-relay-password-7c2e" if case == "wrong_password" else PASSWORDS["relay"]
    if case == "wrong_password":
        dsn, cause = pg.dsn("relay", password=secret), "password authentication failed"
    else:
        dsn, cause = pg.dsn("relay", ca=pg.other_ca_file), "certificate verify failed"
    env = {"NOTIFY_OUTBOX_CONNECT_TIMEOUT": "5s"}
    with RelayProcess(dsn, services.bootstrap, env=env) as relay:
        code = await anyio.to_thread.run_sync(relay.wait, 60.0)
    assert code != 0, relay.output()
    assert relay.matching(cause), relay.output()
    assert not relay.matching(secret)
