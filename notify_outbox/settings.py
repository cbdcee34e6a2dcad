"""Moved to ``notify_outbox.core.settings``; this module re-exports its public names, and
``redact`` (now in ``notify_outbox.core.logs``) and ``load_settings_from_flags`` (now in
``notify_outbox.cli.flags``), which it used to hold."""

from .cli.flags import load_settings_from_flags
from .core.logs import redact
from .core.settings import (
    DatabaseSettings,
    OutboxSettings,
    Seconds,
    load_settings,
    unknown_variables,
    warn_unknown_variables,
)

__all__ = [
    "DatabaseSettings",
    "OutboxSettings",
    "Seconds",
    "load_settings",
    "load_settings_from_flags",
    "redact",
    "unknown_variables",
    "warn_unknown_variables",
]
