"""The inbox's part of the command line: ``migrate --inbox``, ``verify --inbox``, ``sql --inbox``
and ``inbox purge --older-than 30d``.

With ``--inbox``, ``--schema`` and ``--table`` name the inbox table (default ``public`` /
``inbox``, or ``NOTIFY_OUTBOX_INBOX_SCHEMA`` / ``NOTIFY_OUTBOX_INBOX_TABLE``) and ``--dsn`` (or
``NOTIFY_OUTBOX_DSN``) is the consumer's database.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from datetime import timedelta

import asyncpg

from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.settings import DatabaseSettings
from notify_outbox.core.timespec import parse_duration
from notify_outbox.inbox import (
    InboxNames,
    migrate_inbox,
    purge_inbox,
    render_inbox_migrations,
    verify_inbox,
)

from .flags import add_connect_timeout_flag, load_settings_from_flags

__all__ = ["add_inbox_command", "add_inbox_flag", "run_inbox_command", "wants_inbox"]

Connect = Callable[[DatabaseSettings], Awaitable[asyncpg.Connection]]
EXIT_OK, EXIT_USAGE, EXIT_OUTDATED = 0, 2, 4


def add_inbox_flag(p: argparse.ArgumentParser) -> None:
    """``--inbox`` on ``migrate``, ``verify`` and ``sql``."""
    p.add_argument(
        "--inbox",
        action="store_true",
        help="the consumer-side inbox table instead of the outbox (--schema/--table then name "
        "the inbox: default public/inbox [NOTIFY_OUTBOX_INBOX_SCHEMA, _INBOX_TABLE])",
    )


def add_inbox_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """The ``inbox`` command and its ``purge`` subcommand."""
    p = sub.add_parser("inbox", parents=[common], help="maintain a consumer's inbox table")
    actions = p.add_subparsers(dest="inbox_action", required=True, metavar="ACTION")
    purge = actions.add_parser(
        "purge",
        parents=[common],
        help="delete processed ids older than --older-than (a message redelivered after its "
        "id was purged is applied again: keep ids longer than the topic's retention)",
    )
    purge.add_argument("--dsn", help="the consumer's PostgreSQL DSN (prefer NOTIFY_OUTBOX_DSN)")
    purge.add_argument("--schema", dest="db_schema", help="inbox schema (default public)")
    purge.add_argument("--table", help="inbox table (default inbox)")
    purge.add_argument(
        "--older-than", required=True, help="a duration: 30d, 12h, 1w, P30D (required)"
    )
    purge.add_argument("--consumer", help="only this consumer's ids (default: every consumer)")
    add_connect_timeout_flag(purge)


def wants_inbox(args: argparse.Namespace) -> bool:
    """Whether the parsed command is one of the inbox's."""
    return bool(getattr(args, "inbox", False)) or args.command == "inbox"


def _names(args: argparse.Namespace) -> InboxNames:
    schema = args.db_schema or os.environ.get("NOTIFY_OUTBOX_INBOX_SCHEMA", "public")
    table = args.table or os.environ.get("NOTIFY_OUTBOX_INBOX_TABLE", "inbox")
    return InboxNames(schema, table)


def run_inbox_command(args: argparse.Namespace, connect: Connect) -> int:
    """Run an inbox command; returns the exit code. Raises ConfigurationError on bad usage."""
    names = _names(args)
    if args.command == "sql":
        if args.grants:
            raise ConfigurationError("--grants is for the outbox; the inbox needs none of its own")
        sys.stdout.write(render_inbox_migrations(names, since=args.since))
        return EXIT_OK
    db = load_settings_from_flags(
        DatabaseSettings, dsn=args.dsn, connect_timeout=args.connect_timeout
    )
    if args.command == "inbox":
        try:
            older_than = parse_duration(args.older_than)
        except ValueError as e:
            raise ConfigurationError(f"--older-than: {e}") from None
        return asyncio.run(_purge(db, connect, names, older_than, args.consumer))
    check = args.command == "verify" or args.check
    return asyncio.run(_migrate(db, connect, names, check))


async def _migrate(db: DatabaseSettings, connect: Connect, names: InboxNames, check: bool) -> int:
    conn = await connect(db)
    try:
        if check:
            report = await verify_inbox(conn, names)
            print(report.describe())
            return EXIT_OK if report.ok else EXIT_OUTDATED
        applied = await migrate_inbox(conn, names)
        print(f"inbox: applied migrations {applied}" if applied else "inbox: already up to date")
        return EXIT_OK
    finally:
        await conn.close()


async def _purge(
    db: DatabaseSettings,
    connect: Connect,
    names: InboxNames,
    older_than: timedelta,
    consumer: str | None,
) -> int:
    conn = await connect(db)
    try:
        deleted = await purge_inbox(conn, older_than, names=names, consumer=consumer)
        print(f"inbox: purged {deleted} ids processed more than {older_than} ago")
        return EXIT_OK
    finally:
        await conn.close()
