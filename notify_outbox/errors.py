"""Exceptions raised by notify-outbox."""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "EventValidationError",
    "MigrationError",
    "NotifyOutboxError",
    "PublisherUnavailable",
]


class NotifyOutboxError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigurationError(NotifyOutboxError, ValueError):
    """A setting is wrong. The message names the setting and never contains a secret."""


class EventValidationError(NotifyOutboxError, ValueError):
    """An event handed to ``enqueue`` cannot be relayed (wrong type, not JSON, too large)."""


class MigrationError(NotifyOutboxError):
    """The database schema is not what this version of notify-outbox expects."""


class PublisherUnavailable(NotifyOutboxError):
    """Kafka cannot take messages right now; rows stay pending and are retried later."""
