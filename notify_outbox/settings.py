"""Moved to ``notify_outbox.core.settings``; this module re-exports its public names."""

from .core.settings import (
    DatabaseSettings,
    OutboxSettings,
    Seconds,
    load_settings,
    load_settings_from_flags,
    redact,
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
