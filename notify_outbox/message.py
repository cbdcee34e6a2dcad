"""Moved to ``notify_outbox.core.message``; this module re-exports its public names."""

from .core.message import (
    AGGREGATE_ID_HEADER,
    AGGREGATE_TYPE_HEADER,
    EVENT_ID_HEADER,
    EVENT_TYPE_HEADER,
    RESERVED_HEADERS,
    KafkaMessage,
    PublishResult,
)

__all__ = [
    "AGGREGATE_ID_HEADER",
    "AGGREGATE_TYPE_HEADER",
    "EVENT_ID_HEADER",
    "EVENT_TYPE_HEADER",
    "RESERVED_HEADERS",
    "KafkaMessage",
    "PublishResult",
]
