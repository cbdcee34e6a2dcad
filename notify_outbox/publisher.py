"""Moved to ``notify_outbox.kafka.publisher`` (the row-to-record mapping to
``notify_outbox.kafka.records``); this module re-exports its public names."""

from .kafka.publisher import (
    KafkaMessage,
    KafkaPublisher,
    Publisher,
    PublishResult,
    RowRejected,
    to_message,
)

__all__ = [
    "KafkaMessage",
    "KafkaPublisher",
    "PublishResult",
    "Publisher",
    "RowRejected",
    "to_message",
]
