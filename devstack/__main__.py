"""Command line for the local stack: ``python -m devstack up|down|status|restart|env``.

``up`` leaves both services running after it exits and prints ``export`` lines,
so ``eval "$(python -m devstack up)"`` points the current shell at them.
Progress and errors go to stderr, so only the exports reach ``eval``.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devstack import Stack, StackError
from devstack._common import cache_root, read_json, write_json
from devstack.pgbouncer import POOL_MODES, PgBouncer

STATE_FILE = "stack.json"
# Exported by `up --pgbouncer`: the maintenance database through each pooler.
PGBOUNCER_DSN_ENV = {
    "transaction": "NOTIFY_OUTBOX_TEST_PGBOUNCER_TX_DSN",
    "session": "NOTIFY_OUTBOX_TEST_PGBOUNCER_SESSION_DSN",
}
_PGBOUNCER_NAMES = {"transaction": "pgb-tx", "session": "pgb-sess"}


def default_dir() -> Path:
    """Where the CLI keeps its stack unless --dir says otherwise."""
    return cache_root() / "stack"


def _load(directory: Path) -> Stack:
    state = read_json(directory / STATE_FILE)
    if not state:
        raise StackError(
            f"no stack in {directory}: run `python -m devstack up --dir {directory}` first"
        )
    return Stack(directory, durable=bool(state.get("durable", True)))


def _save(stack: Stack) -> None:
    pg, kafka = stack.postgres, stack.kafka
    state: dict[str, Any] = {
        "base_dir": str(stack.base_dir),
        "durable": stack.durable,
        "postgres": {
            "port": pg.port,
            "pid": pg.pid,
            "dsn": pg.dsn,
            "log": str(pg.log_path),
        },
        "kafka": {
            "port": kafka.port,
            "controller_port": kafka.controller_port,
            "pid": kafka.pid,
            "bootstrap_servers": kafka.bootstrap_servers,
            "log": str(kafka.log_path),
        },
    }
    write_json(stack.base_dir / STATE_FILE, state)


def _exports(stack: Stack) -> str:
    env = stack.env()
    # The relay's own settings, so it can be run by hand against the same stack.
    env["NOTIFY_OUTBOX_DSN"] = stack.postgres.dsn
    env["NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS"] = stack.kafka.bootstrap_servers
    for pooler in _poolers(stack):
        if pooler.is_running:
            env[PGBOUNCER_DSN_ENV[pooler.pool_mode]] = pooler.dsn_for("postgres")
    return "".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items())


def _poolers(stack: Stack, *, create: bool = False) -> list[PgBouncer]:
    """The stack's PgBouncers (those ``up --pgbouncer`` made, or all modes if ``create``)."""
    poolers = []
    for mode in POOL_MODES:
        base = stack.base_dir / "pgbouncer" / mode
        if create or base.is_dir():
            poolers.append(PgBouncer(base, postgres_port=stack.postgres.port, pool_mode=mode))
    return poolers


def _cmd_up(args: argparse.Namespace) -> int:
    directory: Path = args.dir
    directory.mkdir(parents=True, exist_ok=True)
    stack = Stack(directory, durable=not args.fast)
    started = time.monotonic()
    stack.start()
    _save(stack)
    for pooler in _poolers(stack, create=args.pgbouncer):
        pooler.start()
        print(f"pgbouncer ({pooler.pool_mode}) on port {pooler.port}", file=sys.stderr)
    print(
        f"stack up in {time.monotonic() - started:.1f}s: postgres {stack.postgres.dsn}, "
        f"kafka {stack.kafka.bootstrap_servers} (state: {directory / STATE_FILE})",
        file=sys.stderr,
    )
    sys.stdout.write(_exports(stack))
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    stack = _load(args.dir)
    for pooler in _poolers(stack):
        pooler.stop()
    stack.stop()
    _save(stack)
    print(f"stack in {stack.base_dir} stopped", file=sys.stderr)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    stack = _load(args.dir)
    pg, kafka = stack.postgres, stack.kafka
    rows = [
        ("postgres", pg.is_running(), pg.pid, pg.dsn, pg.log_path),
        ("kafka", kafka.is_running(), kafka.pid, kafka.bootstrap_servers, kafka.log_path),
    ]
    rows.extend(
        (_PGBOUNCER_NAMES[p.pool_mode], p.is_running, p.pid, p.dsn_for("postgres"), p.log_path)
        for p in _poolers(stack)
    )
    for name, running, pid, address, log in rows:
        state = f"running (pid {pid})" if running else "stopped"
        print(f"{name:<9} {state:<22} {address}  log: {log}")
    return 0 if all(row[1] for row in rows) else 3


def _cmd_restart(args: argparse.Namespace) -> int:
    stack = _load(args.dir)
    started = time.monotonic()
    if args.service == "postgres":
        stack.postgres.restart()
    else:
        stack.kafka.restart()
    _save(stack)
    print(f"{args.service} restarted in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    sys.stdout.write(_exports(_load(args.dir)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m devstack``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dir",
        type=lambda value: Path(value).expanduser().resolve(),
        default=default_dir(),
        help="directory holding the stack's data, logs and state (default: %(default)s)",
    )
    parser = argparse.ArgumentParser(
        prog="python -m devstack",
        description="Run a local PostgreSQL and Kafka for notify-outbox's tests, without Docker.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = sub.add_parser(
        "up", parents=[common], help="start both services and print export lines for a shell"
    )
    up.add_argument(
        "--fast",
        action="store_true",
        help="fsync/synchronous_commit/full_page_writes off (tests); default keeps them on",
    )
    up.add_argument(
        "--pgbouncer",
        action="store_true",
        help="also run PgBouncer in transaction and session mode (installs Debian's package "
        "when missing)",
    )
    up.set_defaults(func=_cmd_up)
    down = sub.add_parser("down", parents=[common], help="stop both services, keep the data")
    down.set_defaults(func=_cmd_down)
    status = sub.add_parser(
        "status", parents=[common], help="show whether each service runs (exit 3 if not both)"
    )
    status.set_defaults(func=_cmd_status)
    restart = sub.add_parser("restart", parents=[common], help="restart one service")
    restart.add_argument("service", choices=["postgres", "kafka"])
    restart.set_defaults(func=_cmd_restart)
    env = sub.add_parser("env", parents=[common], help="print export lines for a running stack")
    env.set_defaults(func=_cmd_env)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="devstack: %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except StackError as exc:
        print(f"devstack: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
