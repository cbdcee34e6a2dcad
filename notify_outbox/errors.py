"""Moved to ``notify_outbox.core.errors``; this module re-exports its public names."""

from .core.errors import (
    ClaimLost,
    ConfigurationError,
    EventValidationError,
    MigrationError,
    NotifyOutboxError,
    PublisherUnavailable,
)

__all__ = [
    "ClaimLost",
    "ConfigurationError",
    "EventValidationError",
    "MigrationError",
    "NotifyOutboxError",
    "PublisherUnavailable",
]
