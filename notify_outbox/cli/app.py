"""The command line: ``notify-outbox`` / ``python -m notify_outbox``.

A thin shell over the same objects the embedded API uses. Exit codes: 0 done (or a graceful
stop), 1 runtime failure, 2 bad usage or settings, 3 stopped by ``shutdown_timeout`` with work
left in flight, 4 ``migrate --check`` found the database out of date, 130 aborted by a second
signal.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NoReturn

import asyncpg

from notify_outbox import __version__
from notify_outbox.core.errors import ConfigurationError, MigrationError
from notify_outbox.core.logs import configure_logging, redact, secrets_from_env
from notify_outbox.core.names import OutboxNames, validate_identifier
from notify_outbox.core.settings import (
    DatabaseSettings,
    OutboxSettings,
    warn_unknown_variables,
)
from notify_outbox.ops.http import HttpSettings, healthcheck_main, serve_monitoring
from notify_outbox.pg.db import (
    DATABASE_ERRORS,
    dsn_address,
    never_heals,
    session_parameters,
    statement_cache_size,
)
from notify_outbox.pg.deadletters import DeadLetterFilter
from notify_outbox.pg.migrations import migrate, render_migrations, verify
from notify_outbox.pg.sqlfiles import Queries, render, sql_dir
from notify_outbox.relay.exactly_once import ExactlyOnceRelay
from notify_outbox.relay.fleet import Fleet, FleetDatabase
from notify_outbox.relay.fleet_file import load_fleet_file
from notify_outbox.relay.relay import Relay

from .admin import (
    add_admin_commands,
    print_requeue,
    print_status,
    run_admin_command,
    wants_admin,
)
from .debezium import add_debezium_command, run_debezium_command, wants_debezium
from .each import for_outboxes
from .flags import add_all_schemas_flag, add_db_flags, add_name_flags, load_settings_from_flags
from .inbox import add_inbox_command, add_inbox_flag, run_inbox_command, wants_inbox

__all__ = ["main"]

log = logging.getLogger("notify_outbox.cli")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_FORCED, EXIT_OUTDATED, EXIT_ABORTED = 0, 1, 2, 3, 4, 130


class _Parser(argparse.ArgumentParser):
    """Bad usage (an unknown flag, a bad value) is one line, not the whole usage text."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = _Parser(  # subcommands' parsers are _Parser too
        prog="notify-outbox",
        description="Relay outbox events from PostgreSQL to Kafka. Settings come from "
        "NOTIFY_OUTBOX_* environment variables; flags override them.",
    )
    # Accepted before or after the command: `notify-outbox run --log-level DEBUG` works too.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level", default=argparse.SUPPRESS, help="DEBUG, INFO (default), WARNING, ERROR"
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "migrate", parents=[common], help="apply pending migrations (safe to run concurrently)"
    )
    add_db_flags(p)
    p.add_argument("--check", action="store_true", help="only check: exit 4 if not up to date")
    add_all_schemas_flag(p)
    p.add_argument(
        "--schemas-like",
        metavar="PATTERN",
        help="with --all-schemas: also create the outbox in every schema whose name matches "
        "this SQL LIKE pattern (new tenants, e.g. 'tenant_%%'), with --channel",
    )
    add_inbox_flag(p)

    p = sub.add_parser("verify", parents=[common], help="same as `migrate --check`")
    add_db_flags(p)
    add_all_schemas_flag(p)
    add_inbox_flag(p)

    p = sub.add_parser(
        "sql", parents=[common], help="print the migrations' SQL for psql, Alembic or Flyway"
    )
    add_name_flags(p)
    p.add_argument("--since", type=int, default=0, help="only migrations after this version")
    p.add_argument("--grants", action="store_true", help="print least-privilege GRANTs instead")
    p.add_argument("--relay-role", default="notify_outbox_relay", help="role of the relay")
    p.add_argument("--app-role", default="notify_outbox_app", help="role of the application")
    add_inbox_flag(p)

    p = sub.add_parser(
        "run", parents=[common], help="run the relay until SIGTERM/SIGINT (twice: abort)"
    )
    add_db_flags(p, connects=False)
    p.add_argument("--kafka-bootstrap-servers", help="[NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS]")
    p.add_argument("--workers", type=int, help="worker coroutines [NOTIFY_OUTBOX_WORKERS]")
    p.add_argument("--batch-size", type=int, help="rows per claim [NOTIFY_OUTBOX_BATCH_SIZE]")
    p.add_argument(
        "--poll-interval",
        help="fallback poll: seconds, or 250ms, 5s, 1m [NOTIFY_OUTBOX_POLL_INTERVAL]",
    )
    p.add_argument(
        "--poll-only", action="store_true", default=None, help="never LISTEN (PgBouncer)"
    )
    p.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop")

    p = sub.add_parser(
        "status", parents=[common], help="print pending, retrying and dead-lettered counts (JSON)"
    )
    add_db_flags(p)
    p.add_argument(
        "--count-limit", type=int, default=100_000, help="count each up to this (bounded work)"
    )
    add_all_schemas_flag(p)

    p = sub.add_parser(
        "notify-mode", parents=[common], help="show or set how producers wake the relay"
    )
    add_db_flags(p)
    p.add_argument(
        "mode",
        nargs="?",
        choices=["gated", "always", "off"],
        help="gated: NOTIFY only while no relay is awake (default); always: every insert; "
        "off: never (the fallback poll finds rows). Restart relays after a change.",
    )
    add_all_schemas_flag(p)

    p = sub.add_parser(
        "delivery",
        parents=[common],
        help="show or set the outbox's delivery mode (relays of the other mode refuse to start)",
    )
    add_db_flags(p)
    p.add_argument(
        "mode",
        nargs="?",
        choices=["at-least-once", "exactly-once"],
        help="at-least-once (default) or exactly-once (Kafka transactions; "
        "docs/concepts/exactly-once.md). Stop every relay of the outbox before a change.",
    )
    add_all_schemas_flag(p)

    p = sub.add_parser(
        "requeue", parents=[common], help="move dead-lettered events back into the outbox"
    )
    add_db_flags(p)
    p.add_argument("ids", nargs="+", type=int, help="ids of dead-lettered rows")

    p = sub.add_parser(
        "healthcheck", parents=[common], help="exit 0 if the local relay's /readyz says ready"
    )
    p.add_argument("--url", help="default: http://$NOTIFY_OUTBOX_HTTP_HOST:$..._PORT/readyz")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait (default 5)")
    add_inbox_command(sub, common)
    add_debezium_command(sub, common)  # Debezium-compatible mode: debezium.py
    add_admin_commands(sub, common)  # dead-letters, replay: admin.py
    return parser


def _overrides(args: argparse.Namespace, *fields: str) -> dict[str, Any]:
    common = ("dsn", "db_schema", "table", "channel", "connect_timeout")
    return {f: getattr(args, f, None) for f in (*common, *fields)}


async def _connect(settings: DatabaseSettings) -> asyncpg.Connection:
    # A command runs a handful of statements: no statement cache, which also makes it work
    # through a transaction-pooling PgBouncer (unless NOTIFY_OUTBOX_STATEMENT_CACHE_SIZE).
    timeout = settings.connect_timeout
    try:
        return await asyncpg.connect(
            settings.dsn.get_secret_value(),
            timeout=timeout,
            statement_cache_size=statement_cache_size(settings.statement_cache_size, True),
            server_settings=session_parameters("notify-outbox-cli"),
        )
    except TimeoutError:
        # A server that accepts TCP but never answers (a firewall, a frozen host) would say
        # nothing else; the address has no user or password in it.
        where = redact(dsn_address(settings.dsn.get_secret_value()), settings)
        raise ConfigurationError(
            f"cannot connect to PostgreSQL at {where} (NOTIFY_OUTBOX_DSN): no answer within "
            f"{timeout:g}s (NOTIFY_OUTBOX_CONNECT_TIMEOUT, --connect-timeout)"
        ) from None
    except DATABASE_ERRORS as e:
        why = never_heals(e)
        raise ConfigurationError(
            f"cannot connect to PostgreSQL (NOTIFY_OUTBOX_DSN): "
            f"{why + ': ' if why else ''}{redact(str(e) or type(e).__name__, settings)}"
        ) from None


async def _migrate(
    settings: DatabaseSettings, check: bool, all_schemas: bool, schemas: str | None = None
) -> int:
    async def one(conn: asyncpg.Connection, names: OutboxNames) -> int:
        if check:
            report = await verify(conn, names)
            print(report.describe())
            return EXIT_OK if report.ok else EXIT_OUTDATED
        applied = await migrate(conn, names)
        print(f"applied migrations {applied}" if applied else "already up to date")
        return EXIT_OK

    return await for_outboxes(_connect, settings, all_schemas, one, schemas=schemas)


async def _status(settings: DatabaseSettings, count_limit: int, all_schemas: bool) -> int:
    async def one(conn: asyncpg.Connection, names: OutboxNames) -> int:
        return await print_status(conn, names, count_limit)

    return await for_outboxes(_connect, settings, all_schemas, one)


async def _notify_mode(settings: DatabaseSettings, mode: str | None, all_schemas: bool) -> int:
    async def one(conn: asyncpg.Connection, names: OutboxNames) -> int:
        q = Queries(names)
        if mode is None:
            print(await conn.fetchval(q["notify_mode"]))
        else:
            print(await conn.fetchval(q["set_notify_mode"], mode))
        return EXIT_OK

    return await for_outboxes(_connect, settings, all_schemas, one)


async def _delivery(settings: DatabaseSettings, mode: str | None, all_schemas: bool) -> int:
    async def one(conn: asyncpg.Connection, names: OutboxNames) -> int:
        q = Queries(names)
        current = await conn.fetchval(q["delivery"])
        if current is None:
            raise MigrationError(
                f"outbox {names.target} predates migration 0007: run `notify-outbox migrate` first"
            )
        print(current if mode is None else await conn.fetchval(q["set_delivery"], mode))
        return EXIT_OK

    return await for_outboxes(_connect, settings, all_schemas, one)


async def _requeue(settings: DatabaseSettings, ids: list[int]) -> int:
    conn = await _connect(settings)
    try:
        # The same as `dead-letters requeue ID...`.
        return await print_requeue(conn, settings.names, DeadLetterFilter(ids=ids), dry_run=False)
    finally:
        await conn.close()


def _fault_hook_from_env() -> Callable[[str], None] | None:
    """Test-only: ``NOTIFY_OUTBOX_TEST_CRASH_AT=after_ack`` kills the process (SIGKILL) the
    first time a batch reaches that point, so fault tests can crash it at an exact step;
    ``NOTIFY_OUTBOX_TEST_STOP_AT=after_claim`` freezes it there (SIGSTOP) the first time, for a
    stall while it holds a claim (the test sends SIGCONT). With
    ``NOTIFY_OUTBOX_TEST_STOP_ARMED=PATH`` the stop waits until that file exists, so that a
    bench can freeze the relay at that point at a moment of its choosing (after a baseline)."""
    crash_at = os.environ.get("NOTIFY_OUTBOX_TEST_CRASH_AT")
    stop_at = os.environ.get("NOTIFY_OUTBOX_TEST_STOP_AT")
    armed = os.environ.get("NOTIFY_OUTBOX_TEST_STOP_ARMED")
    if not crash_at and not stop_at:
        return None
    stopped = False

    def hook(reached: str) -> None:
        nonlocal stopped
        if reached == crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if reached == stop_at and not stopped and (armed is None or os.path.exists(armed)):
            stopped = True
            os.kill(os.getpid(), signal.SIGSTOP)

    return hook


def _install_signal_handlers(
    loop: asyncio.AbstractEventLoop, on_signal: Callable[[int], None]
) -> Callable[[], None]:
    """Send SIGTERM and SIGINT to ``on_signal`` on ``loop``'s thread; returns what undoes it.

    Where the loop cannot watch signals (``add_signal_handler`` raises NotImplementedError on
    Windows), a plain ``signal.signal`` handler passes them to the loop instead, through
    ``call_soon_threadsafe`` (which also wakes a loop blocked in its selector)."""
    undo: list[Callable[[], object]] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        before = signal.getsignal(sig)
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except NotImplementedError:
            previous = signal.signal(
                sig, lambda signum, _frame: loop.call_soon_threadsafe(on_signal, signum)
            )
            # None: a handler not installed from Python, which cannot be put back; the default.
            restore = previous if previous is not None else signal.SIG_DFL
            undo.append(functools.partial(signal.signal, sig, restore))
        else:
            undo.append(functools.partial(_remove_loop_handler, loop, sig, before))

    def uninstall() -> None:
        for step in reversed(undo):
            step()

    return uninstall


def _remove_loop_handler(
    loop: asyncio.AbstractEventLoop, sig: int, previous: Callable[..., object] | int | None
) -> None:
    """Take the loop's handler off ``sig`` and put back the one before it: asyncio's own
    removal installs the default (Python's KeyboardInterrupt for SIGINT), even where SIGINT
    was ignored, as it is for a job started in the background by a non-interactive shell."""
    loop.remove_signal_handler(sig)
    if previous is not None:
        signal.signal(sig, previous)


async def _run_exactly_once(settings: OutboxSettings) -> int:
    relay = ExactlyOnceRelay(
        settings,
        fault_hook=_fault_hook_from_env(),
        # Test-only: the fault suite's control (a recovery that cannot tell what committed).
        trust_markers=os.environ.get("NOTIFY_OUTBOX_TEST_EOS_IGNORE_MARKERS") != "1",
    )
    uninstall = _install_signal_handlers(
        asyncio.get_running_loop(), lambda _s: relay.request_stop()
    )
    try:
        async with serve_monitoring(relay, settings):  # /metrics etc. if http_port is set
            await relay.run()
    finally:
        uninstall()
    return EXIT_OK if relay.outcome == "stopped" else EXIT_FAILED


def _stop_then_abort(stop: Callable[[], None], abort: Callable[[], None]) -> Callable[[int], None]:
    """A signal handler: the first SIGTERM/SIGINT stops gracefully, a second one aborts."""
    seen = 0

    def on_signal(signum: int) -> None:
        nonlocal seen
        seen += 1
        log.info("received %s", signal.Signals(signum).name)
        (stop if seen == 1 else abort)()

    return on_signal


async def _run_fleet(settings: OutboxSettings) -> int:
    databases = (
        load_fleet_file(settings.fleet_file, settings)
        if settings.fleet_file is not None
        else [FleetDatabase.from_settings(settings)]
    )
    fleet = Fleet(
        databases,
        outbox_workers=settings.outbox_workers,
        discovery_interval=settings.discovery_interval,
        fault_hook=_fault_hook_from_env(),
    )
    uninstall = _install_signal_handlers(
        asyncio.get_running_loop(), _stop_then_abort(fleet.request_stop, fleet.abort)
    )
    try:
        async with serve_monitoring(fleet, settings):  # /metrics etc. if http_port is set
            await fleet.run()
    finally:
        uninstall()
    return {"stopped": EXIT_OK, "aborted": EXIT_ABORTED}.get(fleet.outcome, EXIT_FAILED)


async def _run_relay(settings: OutboxSettings) -> int:
    if settings.delivery == "exactly-once":
        return await _run_exactly_once(settings)
    if settings.outboxes is not None or settings.fleet_file is not None:
        return await _run_fleet(settings)
    relay = Relay(settings, fault_hook=_fault_hook_from_env())
    loop = asyncio.get_running_loop()
    uninstall = _install_signal_handlers(loop, _stop_then_abort(relay.request_stop, relay.abort))
    try:
        ready = asyncio.ensure_future(relay.wait_ready())

        def announce(f: asyncio.Future[None]) -> None:
            # Also called when the relay ended before it was ready (the future is then
            # cancelled): say "running" only if it ran.
            if not f.cancelled():
                log.info(
                    "relay running: %d workers, %s, table %s, Kafka %s",
                    settings.workers,
                    "poll-only" if settings.poll_only else f"listening on {settings.channel!r}",
                    settings.names.qualified_table,
                    settings.kafka_bootstrap_servers,
                )

        ready.add_done_callback(announce)
        try:
            async with serve_monitoring(relay, settings):  # /metrics etc. if http_port is set
                await relay.run()
        finally:
            ready.cancel()
    finally:
        uninstall()
    return {"stopped": EXIT_OK, "forced": EXIT_FORCED, "aborted": EXIT_ABORTED}.get(
        relay.outcome, EXIT_FAILED
    )


def _names_from(args: argparse.Namespace) -> OutboxNames:
    env = os.environ

    def pick(flag: str | None, variable: str, default: str) -> str:
        # An empty flag is a bad name like any other, not "use the default".
        return flag if flag is not None else env.get(variable, default)

    return OutboxNames(
        schema=pick(args.db_schema, "NOTIFY_OUTBOX_DB_SCHEMA", "public"),
        table=pick(args.table, "NOTIFY_OUTBOX_TABLE", "outbox"),
        channel=pick(args.channel, "NOTIFY_OUTBOX_CHANNEL", "notify_outbox"),
    )


def _print_sql(args: argparse.Namespace) -> int:
    names = _names_from(args)
    if not args.grants:
        sys.stdout.write(render_migrations(names, since=args.since))
        return EXIT_OK
    text = render(
        (sql_dir() / "grants.sql")
        .read_text(encoding="utf-8")
        .replace("@relay_role@", '"' + validate_identifier(args.relay_role, "--relay-role") + '"')
        .replace("@app_role@", '"' + validate_identifier(args.app_role, "--app-role") + '"'),
        names,
    )
    sys.stdout.write(text)
    return EXIT_OK


#: Allocations (net, of container objects) between the cyclic collector's young-generation
#: runs in the relay daemon; Python's default is 700.
GC_YOUNG_THRESHOLD = 50_000


def tune_gc() -> None:
    """The relay daemon's garbage collector: what was loaded so far (modules, settings) is
    frozen out of every collection, and the young generation is collected every 50,000 net
    allocations rather than 700. A drain makes and drops a few objects per event, nearly none
    in reference cycles; with the defaults the collector ran 330 times per 100,000 events and
    took 2.3 µs of CPU per event (18% of the relay's). Only ``python -m notify_outbox``'s relay
    does this: an application that embeds ``Relay`` keeps its own collector settings."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def _run_async(coro: Coroutine[Any, Any, int], *, uvloop_ok: bool) -> int:
    if uvloop_ok:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return int(uvloop.run(coro))
    return asyncio.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``notify-outbox`` command; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        # NOTIFY_OUTBOX_LOG_FORMAT=json: one JSON object a line (core/logs.py); secrets redacted.
        fmt = os.environ.get("NOTIFY_OUTBOX_LOG_FORMAT")
        configure_logging(args.log_level, fmt, secrets=secrets_from_env(getattr(args, "dsn", None)))
        # A mistyped variable would leave its setting at the default without a word.
        warn_unknown_variables(settings=(DatabaseSettings, OutboxSettings, HttpSettings))
        all_schemas = bool(getattr(args, "all_schemas", False))
        if all_schemas and (args.db_schema or getattr(args, "inbox", False)):
            raise ConfigurationError(
                "--all-schemas serves every outbox table named --table (NOTIFY_OUTBOX_TABLE) "
                "in the database: it does not go with --schema or --inbox"
            )
        if wants_admin(args):  # dead-letters, replay: admin.py
            return run_admin_command(args, _connect)
        if wants_debezium(args):  # Debezium-compatible mode: debezium.py
            return run_debezium_command(args, _connect)
        if wants_inbox(args):  # the consumer side: inbox.py
            return run_inbox_command(args, _connect)
        if args.command == "sql":
            return _print_sql(args)
        if args.command == "healthcheck":
            return healthcheck_main(args.url, args.timeout)
        if args.command in ("migrate", "verify"):
            db = load_settings_from_flags(DatabaseSettings, **_overrides(args))
            check = args.command == "verify" or args.check
            schemas = getattr(args, "schemas_like", None)
            if schemas is not None and not all_schemas:
                raise ConfigurationError("--schemas-like goes with --all-schemas")
            return asyncio.run(_migrate(db, check, all_schemas, schemas))
        if args.command == "status":
            db = load_settings_from_flags(DatabaseSettings, **_overrides(args))
            return asyncio.run(_status(db, args.count_limit, all_schemas))
        if args.command == "notify-mode":
            db = load_settings_from_flags(DatabaseSettings, **_overrides(args))
            return asyncio.run(_notify_mode(db, args.mode, all_schemas))
        if args.command == "delivery":
            db = load_settings_from_flags(DatabaseSettings, **_overrides(args))
            return asyncio.run(_delivery(db, args.mode, all_schemas))
        if args.command == "requeue":
            db = load_settings_from_flags(DatabaseSettings, **_overrides(args))
            return asyncio.run(_requeue(db, args.ids))
        settings = load_settings_from_flags(
            OutboxSettings,
            **_overrides(
                args,
                "kafka_bootstrap_servers",
                "workers",
                "batch_size",
                "poll_interval",
                "poll_only",
            ),
        )
        tune_gc()
        return _run_async(_run_relay(settings), uvloop_ok=not args.no_uvloop)
    except ConfigurationError as e:
        print(f"notify-outbox: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (MigrationError, asyncpg.PostgresError) as e:
        print(f"notify-outbox: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_ABORTED
