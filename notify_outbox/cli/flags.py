"""The flags the commands share, and settings built from them (flags win over the environment).

One home for ``--dsn``, ``--schema``, ``--table``, ``--channel`` and ``--connect-timeout``, so the
relay's commands and the operators' commands (``admin.py``) spell and explain them alike.
"""

from __future__ import annotations

import argparse
from typing import Any, TypeVar

from notify_outbox.core.settings import DatabaseSettings, load_settings

__all__ = [
    "add_all_schemas_flag",
    "add_connect_timeout_flag",
    "add_db_flags",
    "add_name_flags",
    "load_settings_from_flags",
]

_S = TypeVar("_S", bound=DatabaseSettings)


def add_connect_timeout_flag(p: argparse.ArgumentParser) -> None:
    """``--connect-timeout`` on a command that connects to PostgreSQL."""
    p.add_argument(
        "--connect-timeout",
        help="give up connecting after this long: seconds, or 500ms, 10s, 1m "
        "(default 10s) [NOTIFY_OUTBOX_CONNECT_TIMEOUT]",
    )


def add_name_flags(p: argparse.ArgumentParser, *, channel: bool = True) -> None:
    """``--schema``, ``--table`` and (unless ``channel`` is False) ``--channel``."""
    p.add_argument("--schema", dest="db_schema", help="outbox schema [NOTIFY_OUTBOX_DB_SCHEMA]")
    p.add_argument("--table", help="outbox table [NOTIFY_OUTBOX_TABLE]")
    if channel:
        p.add_argument("--channel", help="NOTIFY channel [NOTIFY_OUTBOX_CHANNEL]")


def add_db_flags(
    p: argparse.ArgumentParser, *, channel: bool = True, connects: bool = True
) -> None:
    """``--dsn`` and the name flags; ``--connect-timeout`` for a command's one connection
    (``connects=False``: ``run`` retries its own instead)."""
    p.add_argument("--dsn", help="PostgreSQL DSN (prefer NOTIFY_OUTBOX_DSN: argv is visible)")
    add_name_flags(p, channel=channel)
    if connects:
        add_connect_timeout_flag(p)


def add_all_schemas_flag(p: argparse.ArgumentParser) -> None:
    """``--all-schemas``: the command on every migrated outbox of the database (a schema per
    tenant), found from the migration records (``pg/discovery.py``)."""
    p.add_argument(
        "--all-schemas",
        action="store_true",
        help="every schema's outbox table named --table (default outbox) that notify-outbox "
        "migrated in this database, one line per outbox prefixed schema.table: (a schema per "
        "tenant); a new schema's outbox is first migrated with --schema",
    )


# Flags spelt otherwise than "--" + the field with dashes.
_FLAG_NAMES = {"db_schema": "--schema"}


def load_settings_from_flags(cls: type[_S], /, **from_flags: Any) -> _S:
    """``load_settings`` for the command line: every override is the value of the flag named
    after its field (``poll_interval`` from ``--poll-interval``, ``db_schema`` from
    ``--schema``), None when the flag was not given; errors name the flags that were."""
    flags = {f: _FLAG_NAMES.get(f, "--" + f.replace("_", "-")) for f in from_flags}
    return load_settings(cls, flags=flags, **from_flags)
