"""Moved to ``notify_outbox.producer.sqlalchemy``; this module re-exports its public names."""

from .producer.sqlalchemy import (
    OutboxTables,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
    outbox_tables,
)

__all__ = [
    "OutboxTables",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
    "outbox_tables",
]
