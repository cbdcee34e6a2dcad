"""Moved to ``notify_outbox.ops.metrics``; this module re-exports its public names."""

from .ops.metrics import (
    OutboxStats,
    Readiness,
    RelayMetrics,
    failure_class,
)

__all__ = [
    "OutboxStats",
    "Readiness",
    "RelayMetrics",
    "failure_class",
]
