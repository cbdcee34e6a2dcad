"""Exceptions raised by notify-outbox."""

from __future__ import annotations

__all__ = [
    "ClaimLost",
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


class ClaimLost(NotifyOutboxError):
    """PostgreSQL ended a claim left idle longer than its timeout: the relay did not run for
    that long (frozen, or starved of CPU). Its rows go to the next claim, of this relay or
    another; nothing is wrong with the database."""


class PublisherUnavailable(NotifyOutboxError):
    """Kafka cannot take messages right now; rows stay pending and are retried later."""
