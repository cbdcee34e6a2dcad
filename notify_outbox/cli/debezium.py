"""The Debezium-compatible mode's part of the command line:
``notify-outbox debezium install | verify | sql``.

``--schema`` / ``--table`` name notify-outbox's own outbox (as everywhere); ``--source-schema``
and ``--source-table`` the Debezium-shaped table (default ``public`` / ``outbox``, or
``NOTIFY_OUTBOX_DEBEZIUM_SCHEMA`` / ``NOTIFY_OUTBOX_DEBEZIUM_TABLE``). Router options come from
a connector configuration file (``--connector-config``, ``NOTIFY_OUTBOX_DEBEZIUM_CONFIG``) and
``--set name=value`` flags, under the router's own names.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg

from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.names import OutboxNames
from notify_outbox.core.settings import DatabaseSettings
from notify_outbox.debezium.capture import (
    DebeziumCapture,
    install_capture,
    parse_connector_config,
    render_capture,
    verify_capture,
)

from .flags import add_connect_timeout_flag, load_settings_from_flags

__all__ = ["add_debezium_command", "run_debezium_command", "wants_debezium"]

Connect = Callable[[DatabaseSettings], Awaitable[asyncpg.Connection]]
EXIT_OK, EXIT_OUTDATED = 0, 4


def add_debezium_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """The ``debezium`` command and its ``install``, ``verify`` and ``sql`` actions."""
    p = sub.add_parser(
        "debezium",
        parents=[common],
        help="relay a table laid out for Debezium's outbox event router (install its capture)",
    )
    actions = p.add_subparsers(dest="debezium_action", required=True, metavar="ACTION")
    for name, text in (
        ("install", "check the Debezium table and install (or update) its capture trigger"),
        ("verify", "exit 4 unless the installed capture matches these options"),
        ("sql", "print the capture's SQL (for the router's default table shape)"),
    ):
        a = actions.add_parser(name, parents=[common], help=text)
        if name != "sql":
            a.add_argument("--dsn", help="PostgreSQL DSN (prefer NOTIFY_OUTBOX_DSN)")
            add_connect_timeout_flag(a)
        a.add_argument("--schema", dest="db_schema", help="notify-outbox's outbox schema")
        a.add_argument("--table", help="notify-outbox's outbox table (not the Debezium one)")
        a.add_argument("--source-schema", help="schema of the Debezium outbox table")
        a.add_argument("--source-table", help="the Debezium outbox table (default outbox)")
        a.add_argument(
            "--connector-config",
            help="a Kafka Connect connector config (.properties or JSON): the EventRouter's "
            "transforms.<name>.* options are read from it [NOTIFY_OUTBOX_DEBEZIUM_CONFIG]",
        )
        a.add_argument(
            "--set",
            dest="options",
            action="append",
            default=[],
            metavar="OPTION=VALUE",
            help="a router option by its Debezium name, e.g. "
            "route.topic.replacement=${routedByValue}.events (repeatable; wins over the file)",
        )


def wants_debezium(args: argparse.Namespace) -> bool:
    """Whether the parsed command is the ``debezium`` one."""
    return bool(args.command == "debezium")


def _capture(args: argparse.Namespace) -> DebeziumCapture:
    env = os.environ
    options: dict[str, str] = {}
    path = args.connector_config or env.get("NOTIFY_OUTBOX_DEBEZIUM_CONFIG")
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigurationError(f"--connector-config: cannot read {path}: {e}") from None
        options.update(parse_connector_config(text))
    for item in args.options:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigurationError(f"--set {item!r}: expected OPTION=VALUE")
        name = name.strip()
        if name.startswith("transforms."):  # pasted with its prefix: transforms.outbox.X
            name = name.split(".", 2)[2] if name.count(".") >= 2 else name
        options[name] = value
    return DebeziumCapture.from_options(
        options,
        schema=args.source_schema or env.get("NOTIFY_OUTBOX_DEBEZIUM_SCHEMA", "public"),
        table=args.source_table or env.get("NOTIFY_OUTBOX_DEBEZIUM_TABLE", "outbox"),
    )


def _names(args: argparse.Namespace) -> OutboxNames:
    env = os.environ
    return OutboxNames(
        schema=args.db_schema or env.get("NOTIFY_OUTBOX_DB_SCHEMA", "public"),
        table=args.table or env.get("NOTIFY_OUTBOX_TABLE", "outbox"),
    )


def run_debezium_command(args: argparse.Namespace, connect: Connect) -> int:
    """Run ``debezium install|verify|sql``; returns the exit code. Raises ConfigurationError
    on bad usage or a table that does not fit the options."""
    capture = _capture(args)
    names = _names(args)
    if args.debezium_action == "sql":
        sys.stdout.write(render_capture(capture, names))
        return EXIT_OK
    db = load_settings_from_flags(
        DatabaseSettings,
        dsn=args.dsn,
        db_schema=args.db_schema,
        table=args.table,
        channel=None,
        connect_timeout=args.connect_timeout,
    )
    return asyncio.run(_apply(db, connect, capture, names, args.debezium_action == "verify"))


async def _apply(
    db: DatabaseSettings,
    connect: Connect,
    capture: DebeziumCapture,
    names: OutboxNames,
    check: bool,
) -> int:
    conn = await connect(db)
    try:
        if check:
            report = await verify_capture(conn, capture, names)
            print(report.describe())
            return EXIT_OK if report.ok else EXIT_OUTDATED
        await install_capture(conn, capture, names)
        print(
            f"Debezium capture installed on {capture.schema}.{capture.table} -> "
            f"{names.schema}.{names.table} (run the relay with NOTIFY_OUTBOX_HEADER_STYLE=debezium)"
        )
        return EXIT_OK
    finally:
        await conn.close()
