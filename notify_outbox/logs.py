"""Moved to ``notify_outbox.core.logs``; this module re-exports its public names."""

from .core.logs import (
    JsonFormatter,
    RedactingFormatter,
    Redactor,
    configure_logging,
    secrets_from_env,
)

__all__ = [
    "JsonFormatter",
    "RedactingFormatter",
    "Redactor",
    "configure_logging",
    "secrets_from_env",
]
