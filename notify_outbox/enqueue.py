"""Moved to ``notify_outbox.producer.enqueue``; this module re-exports its public names."""

from .producer.enqueue import (
    DEFAULT_MAX_EVENT_BYTES,
    RESERVED_HEADERS,
    OutboxEvent,
    PreparedEvent,
    enqueue,
    enqueue_many,
    prepare_events,
)

__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "RESERVED_HEADERS",
    "OutboxEvent",
    "PreparedEvent",
    "enqueue",
    "enqueue_many",
    "prepare_events",
]
