"""The fleet file (``NOTIFY_OUTBOX_FLEET_FILE``): the databases one relay process serves, and
which outboxes of each. Every other setting comes from the environment as usual, shared by all.

.. code-block:: toml

    [[database]]                     # a schema per tenant
    dsn_env = "TENANTS_DSN"          # the variable holding the DSN (or dsn_file, or dsn)
    outboxes = "*"                   # every migrated outbox, re-checked while running
    schemas_like = "tenant\\\\_%"      # optional: only these schemas

    [[database]]                     # a service's own database
    dsn_file = "/run/secrets/billing_dsn"
    outboxes = ["public.outbox"]     # a list of schema.table
    channel = "billing_events"       # optional: the listed outboxes' channel

A database that names no DSN uses ``NOTIFY_OUTBOX_DSN``. Secrets belong in ``dsn_env`` or
``dsn_file``, not in the file itself; no error message ever quotes a DSN.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import SecretStr, ValidationError

from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.names import OutboxNames
from notify_outbox.core.settings import (
    OutboxSettings,
    format_validation_error,
    read_secret_file,
)

from .fleet import FleetDatabase

__all__ = ["load_fleet_file"]

_KEYS = {"dsn", "dsn_env", "dsn_file", "outboxes", "schemas_like", "channel"}


def load_fleet_file(path: Path, settings: OutboxSettings) -> list[FleetDatabase]:
    """The databases of the fleet file at ``path``, each with ``settings`` (its DSN and
    channel replaced). Raises ConfigurationError naming the file, the entry and the key."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigurationError(
            f"cannot read the fleet file {path} (NOTIFY_OUTBOX_FLEET_FILE): {e.strerror}"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigurationError(f"the fleet file {path} is not valid TOML: {e}") from None
    entries = data.get("database")
    if not isinstance(entries, list) or not entries or set(data) != {"database"}:
        raise ConfigurationError(
            f"the fleet file {path} must hold one or more [[database]] tables, and nothing else"
        )
    return [_database(path, n, entry, settings) for n, entry in enumerate(entries, 1)]


def _database(path: Path, n: int, entry: Any, settings: OutboxSettings) -> FleetDatabase:
    where = f"the fleet file {path}, [[database]] number {n}"
    if not isinstance(entry, dict):
        raise ConfigurationError(f"{where}: not a table")
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise ConfigurationError(
            f"{where}: unknown key {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})"
        )
    sources = [k for k in ("dsn", "dsn_env", "dsn_file") if k in entry]
    if len(sources) > 1:
        raise ConfigurationError(f"{where}: give one of dsn, dsn_env and dsn_file")
    update: dict[str, Any] = {}
    if sources:
        update["dsn"] = SecretStr(_dsn(where, sources[0], entry[sources[0]]))
        update["listen_dsn"] = None  # NOTIFY_OUTBOX_LISTEN_DSN is the default database's
    channel = entry.get("channel", settings.channel)
    outboxes = entry.get("outboxes")
    try:
        update["channel"] = OutboxNames(channel=channel).channel
        try:
            base = OutboxSettings(**{**settings.model_dump(), **update, "outboxes": None})
        except ValidationError as e:
            raise ConfigurationError(format_validation_error(e)) from None
        if outboxes == "*":
            return FleetDatabase(base, discover=True, schemas_like=entry.get("schemas_like"))
        if not isinstance(outboxes, list) or not outboxes:
            raise ConfigurationError('outboxes must be "*" or a list of "schema.table"')
        if "schemas_like" in entry:
            raise ConfigurationError('schemas_like is used only with outboxes = "*"')
        listed = []
        for target in outboxes:
            schema, dot, table = str(target).partition(".")
            if not dot:
                raise ConfigurationError(f"outbox {target!r} is not schema.table")
            listed.append(OutboxNames(schema, table, channel))
        return FleetDatabase(base, outboxes=tuple(listed))
    except ConfigurationError as e:
        raise ConfigurationError(f"{where}: {e}") from None


def _dsn(where: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{where}: {key} must be a non-empty string")
    if key == "dsn":
        return value
    if key == "dsn_env":
        found = os.environ.get(value)
        if not found:
            raise ConfigurationError(f"{where}: the variable {value} (dsn_env) is not set")
        return found
    return read_secret_file(f"{where}: dsn_file", value)
