"""Schema, names, secrets and privileges: the operator's side of the faults.

Scenarios (reliability.md): 18 migrations in order equal the declared schema, concurrent
``migrate``; 19 configurable names with quotes, semicolons, > 63 bytes; 20 secrets never in
logs, tracebacks or validation errors; 21 least-privilege roles.
"""

from __future__ import annotations

import re
import signal
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from urllib.parse import quote

import anyio
import pytest

from devstack.relayproc import child_env, cli_argv
from notify_outbox.cli.app import main as cli_main
from notify_outbox.pg.sqlfiles import load_migrations
from tests.conftest import Services
from tests.faults.checker import OutboxChecker
from tests.faults.harness import FaultRelay, connect, fetchval, relays, task_group
from tests.support import ROOT, dsn_with_user

pytestmark = pytest.mark.anyio


async def cli(*args: str, env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """A one-shot CLI command; returns its exit code and everything it printed."""
    result = await anyio.run_process(
        cli_argv(*args),
        cwd=ROOT,
        env=child_env(**(env or {})),
        check=False,
        stderr=subprocess.STDOUT,
    )
    return result.returncode, result.stdout.decode(errors="replace")


async def run_until(
    args: Sequence[str], env: Mapping[str, str], pattern: str, *, count: int = 2
) -> tuple[int, str]:
    """``notify-outbox run`` until it has logged ``pattern`` ``count`` times (it retries
    forever against a server it cannot use), then SIGTERM; returns the exit code and all it
    printed, on stdout and stderr."""
    regex = re.compile(pattern)
    lines: list[str] = []
    async with await anyio.open_process(
        cli_argv("run", *args),
        cwd=ROOT,
        env=child_env(**env),
        stderr=subprocess.STDOUT,
    ) as proc:
        assert proc.stdout is not None
        buffer = b""
        with anyio.move_on_after(60):
            async for chunk in proc.stdout:
                buffer += chunk
                lines[:] = buffer.decode(errors="replace").splitlines()
                if sum(1 for line in lines if regex.search(line)) >= count:
                    break
        hits = sum(1 for line in lines if regex.search(line))
        assert hits >= count, f"no {pattern!r} x{count} within 60s:\n" + "\n".join(lines[-30:])
        proc.send_signal(signal.SIGTERM)
        with anyio.fail_after(30):
            async for chunk in proc.stdout:
                buffer += chunk
            code = await proc.wait()
    return code, buffer.decode(errors="replace")


# --- 18 ---------------------------------------------------------------------------------------


async def test_18_migrations_in_order_equal_the_schema_and_concurrent_migrate_is_safe(
    empty_db_dsn: str,
) -> None:
    """Two `migrate` processes start at once on an empty database: one applies every
    migration, in order, the other waits on the lock and finds nothing to do; `verify` then
    finds the schema exactly as the migrations declare it."""
    env = {"NOTIFY_OUTBOX_DSN": empty_db_dsn}
    results: list[tuple[int, str]] = []

    async def one() -> None:
        results.append(await cli("migrate", env=env))

    async with task_group() as tg:
        for _ in range(3):
            tg.start_soon(one)
    versions = [m.version for m in load_migrations()]
    assert [code for code, _ in results] == [0, 0, 0], results
    outputs = sorted(out.strip().splitlines()[-1] for _, out in results)
    assert outputs == sorted([f"applied migrations {versions}"] + ["already up to date"] * 2)
    code, out = await cli("verify", env=env)
    assert code == 0, out
    assert "up to date" in out, out
    assert "schema matches" in out, out
    async with connect(empty_db_dsn) as conn:
        rows = await conn.fetch(
            "SELECT version FROM notify_outbox_migrations WHERE target = 'public.outbox' "
            "ORDER BY applied_at, version"
        )
    assert [r["version"] for r in rows] == versions


# --- 19 ---------------------------------------------------------------------------------------

BAD_NAMES = [
    'outbox"; DROP TABLE outbox; --',
    "a;b",
    "o'brien",
    'quo"te',
    "x" * 64,
    "Upper",
    "with space",
    "ünïcode",
]


@pytest.mark.parametrize("setting", ["schema", "table", "channel"])
async def test_19_bad_names_are_rejected_and_never_reach_sql(
    empty_db_dsn: str,
    services: Services,
    setting: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every bad name, given as a flag or as an environment variable, to `migrate`, `run` and
    `sql`, is rejected with exit code 2 and a message naming the setting; the database is left
    untouched. The limits themselves are accepted: 63 bytes (40 for the table).

    The whole matrix runs through the CLI's ``main()`` in this process (fast); a few cases
    also run as real subprocesses."""
    variable = {"schema": "NOTIFY_OUTBOX_DB_SCHEMA", "table": "NOTIFY_OUTBOX_TABLE"}.get(
        setting, "NOTIFY_OUTBOX_CHANNEL"
    )
    base = {
        "NOTIFY_OUTBOX_DSN": empty_db_dsn,
        "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.bootstrap,
    }
    names = [*BAD_NAMES, "t" * 41] if setting == "table" else BAD_NAMES
    failures: list[str] = []
    for key, value in base.items():
        monkeypatch.setenv(key, value)
    for name in names:
        for command in ("migrate", "run", "sql"):
            for how in ("flag", "env"):
                if how == "env":
                    monkeypatch.setenv(variable, name)
                    argv = [command]
                else:
                    monkeypatch.delenv(variable, raising=False)
                    argv = [command, f"--{setting}", name]
                code = cli_main(argv)
                out = "".join(capsys.readouterr())
                if code != 2 or not (setting in out.lower() or variable in out):
                    failures.append(f"{argv} ({how}): exit {code}: {out[:300]}")
    monkeypatch.delenv(variable, raising=False)
    assert not failures, "\n".join(failures[:10])
    for args in (("migrate", f"--{setting}", BAD_NAMES[0]), ("sql", f"--{setting}", "a;b")):
        code, out = await cli(*args, env=base)
        assert code == 2, f"{args}: exit {code}: {out}"
        assert "Traceback" not in out, out
    async with connect(empty_db_dsn) as conn:
        created = await conn.fetchval(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')"
        )
    assert created == 0, "a rejected name still created something"
    # The limits: exactly 63 bytes (40 for the table, whose derived names add suffixes).
    longest = "n" * (40 if setting == "table" else 63)
    code, out = await cli("migrate", f"--{setting}", longest, env=base)
    assert code == 0, out
    code, out = await cli("verify", f"--{setting}", longest, env=base)
    assert code == 0, out


@pytest.mark.parametrize("setting", ["schema", "table", "channel"])
async def test_19_an_empty_name_is_rejected_by_every_command(setting: str) -> None:
    """`--table ''` (say, from an unset shell variable) must be an error like any other bad
    name, not silently become the default name: `migrate` and `run` reject it, and `sql` must
    too, or it prints SQL for another table than the one asked for."""
    env = {
        "NOTIFY_OUTBOX_DSN": "postgresql://app@127.0.0.1:1/db",
        "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
    }
    for command in ("migrate", "run", "sql"):
        code, out = await cli(command, f"--{setting}", "", env=env)
        assert code == 2, f"{command} --{setting} '': exit {code}: {out[:300]}"


# --- 20 ---------------------------------------------------------------------------------------

SECRET = "s3cr3t-Kx7"  # the part of every password below that must never be printed


def _assert_no_secret(code: int, out: str, case: str) -> None:
    encoded = quote(SECRET, safe="")
    assert SECRET not in out, f"{case}: the password leaked:\n{out}"
    assert encoded not in out, f"{case}: the password leaked (percent-encoded):\n{out}"


async def test_20_secrets_never_appear_in_logs_or_errors(db_dsn: str, services: Services) -> None:
    """Database and SASL passwords, in every way the relay can be told them and every way it
    can fail with them (unreachable server, wrong password, unknown role, broker that refuses
    SASL, bad settings), never appear in its output, even at DEBUG level."""
    role = f"fault_app_{uuid.uuid4().hex[:8]}"
    async with connect(db_dsn) as conn:
        await conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'the-right-one'")
    special = SECRET + "@:/?#%&"  # percent-encoded in the DSN, as it must be
    unreachable = f"postgresql://app:{SECRET}@127.0.0.1:1/db"
    wrong_password = dsn_with_user(db_dsn, role, SECRET)
    unknown_role = dsn_with_user(db_dsn, "nobody_" + uuid.uuid4().hex[:6], SECRET)
    encoded = f"postgresql://app:{quote(special, safe='')}@127.0.0.1:1/db"
    kafka = {"NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.bootstrap}
    debug = ("--log-level", "DEBUG")
    not_reachable = r"PostgreSQL not reachable"
    try:
        runs = [
            ("unreachable", debug, {**kafka, "NOTIFY_OUTBOX_DSN": unreachable}, not_reachable),
            ("encoded special", debug, {**kafka, "NOTIFY_OUTBOX_DSN": encoded}, not_reachable),
            *(
                (
                    f"SASL {mechanism}",
                    debug,
                    {
                        **kafka,
                        "NOTIFY_OUTBOX_DSN": db_dsn,
                        "NOTIFY_OUTBOX_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
                        "NOTIFY_OUTBOX_KAFKA_SASL_MECHANISM": mechanism,
                        "NOTIFY_OUTBOX_KAFKA_SASL_USERNAME": "relay",
                        "NOTIFY_OUTBOX_KAFKA_SASL_PASSWORD": SECRET,
                    },
                    r"Kafka not reachable",
                )
                for mechanism in ("PLAIN", "SCRAM-SHA-256")
            ),
        ]
        # Refusals that no retry cures stop `run` at once (exit 2) with the reason, instead
        # of being retried as an outage.
        refused = [
            ("wrong password", debug, {**kafka, "NOTIFY_OUTBOX_DSN": wrong_password}),
            ("unknown role", debug, {**kafka, "NOTIFY_OUTBOX_DSN": unknown_role}),
            ("--dsn flag", (*debug, "--dsn", wrong_password), kafka),
        ]
        invalid = [
            {"NOTIFY_OUTBOX_DSN": f"mysql://app:{SECRET}@db/x"},
            {"NOTIFY_OUTBOX_DSN": unreachable, "NOTIFY_OUTBOX_WORKERS": "many"},
            {
                "NOTIFY_OUTBOX_DSN": unreachable,
                "NOTIFY_OUTBOX_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                "NOTIFY_OUTBOX_KAFKA_SASL_PASSWORD": SECRET,
            },
            {
                "NOTIFY_OUTBOX_DSN": unreachable,
                "NOTIFY_OUTBOX_KAFKA_SSL_PASSWORD": SECRET,
                "NOTIFY_OUTBOX_KAFKA_SSL_CAFILE": f"/nonexistent/{SECRET}",
                "NOTIFY_OUTBOX_KAFKA_LINGER_MS": SECRET,
            },
        ]
        limiter = anyio.CapacityLimiter(3)  # two cores: a few processes at a time

        async def relay_case(
            case: str, args: Sequence[str], env: dict[str, str], pattern: str
        ) -> None:
            async with limiter:
                code, out = await run_until(args, env, pattern)
            assert code == 0, f"{case}: exit {code}:\n{out[-3000:]}"
            _assert_no_secret(code, out, case)

        async def refused_case(case: str, args: Sequence[str], env: dict[str, str]) -> None:
            async with limiter:
                code, out = await cli("run", *args, env=env)
            assert code == 2, f"{case}: exit {code}:\n{out[-3000:]}"
            assert "the password was refused" in out, f"{case}:\n{out[-3000:]}"
            assert "Traceback" not in out, out
            _assert_no_secret(code, out, case)

        async def command_case(command: str, dsn: str) -> None:
            extra = ("1",) if command == "requeue" else ()
            async with limiter:
                code, out = await cli(command, *extra, env={"NOTIFY_OUTBOX_DSN": dsn})
            assert code == 2, f"{command}: exit {code}: {out}"
            assert "cannot connect to PostgreSQL" in out, out
            _assert_no_secret(code, out, command)

        async def invalid_case(env: dict[str, str]) -> None:
            async with limiter:
                code, out = await cli("run", env={**kafka, **env})
            assert code == 2, f"{env}: exit {code}: {out}"
            assert "Traceback" not in out, out
            _assert_no_secret(code, out, f"invalid settings {sorted(env)}")

        async with task_group() as tg:
            for run in runs:
                tg.start_soon(relay_case, *run)
            for refusal in refused:
                tg.start_soon(refused_case, *refusal)
            for command in ("migrate", "verify", "status", "requeue"):
                for dsn in (unreachable, wrong_password, encoded):
                    tg.start_soon(command_case, command, dsn)
            for env in invalid:
                tg.start_soon(invalid_case, env)
    finally:
        async with connect(db_dsn) as conn:
            await conn.execute(f"DROP ROLE IF EXISTS {role}")


@pytest.mark.parametrize("char", ["#", "/", "?"])
async def test_20_a_password_with_an_unencoded_url_character_is_a_setting_error(
    services: Services, char: str
) -> None:
    """A password with a character that ends the authority part of a URL, left unencoded: a
    common slip. The DSN then parses with the rest of the password as the port. It must be
    reported as a wrong setting (exit 2), and the password must not appear anywhere, not in
    a traceback either."""
    dsn = f"postgresql://app:{SECRET}{char}x@127.0.0.1:5432/db"
    env = {"NOTIFY_OUTBOX_DSN": dsn, "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.bootstrap}
    for command in ("run", "migrate", "status"):
        code, out = await cli(command, env=env)
        _assert_no_secret(code, out, f"{command} with an unencoded {char!r}")
        assert code == 2, f"{command}: exit {code} (a wrong setting is exit 2):\n{out[-2000:]}"
        assert "Traceback" not in out, out


# --- 21 ---------------------------------------------------------------------------------------


async def test_21_least_privilege_roles(db_dsn: str, services: Services, topic: str) -> None:
    """The relay runs as a role with only the documented grants (`sql --grants`), the
    application inserts as a role that can only INSERT into the outbox (it cannot read,
    change or delete events), and everything is delivered; a malformed row is dead-lettered
    and re-queued by the relay role too."""
    suffix = uuid.uuid4().hex[:8]
    relay_role, app_role = f"relay_{suffix}", f"app_{suffix}"
    code, grants = await cli("sql", "--grants", "--relay-role", relay_role, "--app-role", app_role)
    assert code == 0, grants
    checker = OutboxChecker(db_dsn, services.bootstrap, [topic], "21 least privilege")
    await checker.setup()
    async with connect(db_dsn) as admin:
        await admin.execute(f"CREATE ROLE {relay_role} LOGIN PASSWORD 'relay-pw'")
        await admin.execute(f"CREATE ROLE {app_role} LOGIN PASSWORD 'app-pw'")
        await admin.execute(grants)
        # The checker's own bookkeeping tables, written in the app's transactions.
        await admin.execute(
            f"GRANT SELECT, INSERT, UPDATE ON fault_key_counter TO {app_role};"
            f"GRANT SELECT, INSERT ON fault_commits TO {app_role}"
        )
    relay_dsn = dsn_with_user(db_dsn, relay_role, "relay-pw")
    app_dsn = dsn_with_user(db_dsn, app_role, "app-pw")
    try:
        async with connect(app_dsn) as app:
            for statement in (
                "SELECT count(*) FROM outbox",
                "UPDATE outbox SET topic = topic",
                "DELETE FROM outbox",
                "SELECT count(*) FROM outbox_dead_letter",
            ):
                with pytest.raises(Exception, match="permission denied"):
                    await app.execute(statement)
        async with connect(relay_dsn) as relay_conn:
            for statement in ("DROP TABLE outbox", "ALTER TABLE outbox DISABLE TRIGGER ALL"):
                with pytest.raises(Exception, match="must be owner"):
                    await relay_conn.execute(statement)
        load = checker.writers(dsn=app_dsn, writers=2, keys=10, max_events=100, stamp=False)
        async with (
            relays(FaultRelay(relay_dsn, services.bootstrap)) as (relay,),
            checker.producer(dsn=app_dsn, stamp=False) as p,
        ):
            await relay.ready()
            await load.run()
            bad = await p.produce("bad-headers", headers='{"n": 1}')
            checker.expect_dead([bad])
            report = await checker.drain_and_check(within=60)
            code, out = await cli("status", env={"NOTIFY_OUTBOX_DSN": relay_dsn})
            assert code == 0, out
            assert '"dead_lettered": 1' in out, out
            dead_id = await fetchval(
                db_dsn, "SELECT id FROM outbox_dead_letter WHERE event_id = $1", uuid.UUID(bad)
            )
            code, out = await cli("requeue", str(dead_id), env={"NOTIFY_OUTBOX_DSN": relay_dsn})
            assert code == 0, out
            await relay.stop_ok()
    finally:
        async with connect(db_dsn) as admin:
            for role in (relay_role, app_role):
                await admin.execute(f"DROP OWNED BY {role}")
                await admin.execute(f"DROP ROLE IF EXISTS {role}")
    print(report.text())
    assert report.duplicates == 0
    report.assert_ok()


async def test_relay_running_is_logged_only_when_the_relay_runs(
    empty_db_dsn: str, services: Services
) -> None:
    """`relay running` is the line operators (and these tests) take as "started". A relay
    that never started (no outbox table: exit 1) must not log it on its way out."""
    code, out = await cli(
        "run",
        env={
            "NOTIFY_OUTBOX_DSN": empty_db_dsn,
            "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.bootstrap,
        },
    )
    assert code == 1, out
    assert "notify-outbox migrate" in out, out
    assert "relay running" not in out, f"a relay that failed to start said it runs:\n{out}"
