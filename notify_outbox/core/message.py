"""What a Kafka record of the relay is, and nothing else: the message, the names of the
headers the relay sets, and the outcome of publishing a batch.

A data-only leaf module (it imports nothing of the package), so that the producer API
(``enqueue``), the publisher, tracing and the inbox can all share these names without
importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "AGGREGATE_ID_HEADER",
    "AGGREGATE_TYPE_HEADER",
    "EVENT_ID_HEADER",
    "EVENT_TYPE_HEADER",
    "RESERVED_HEADERS",
    "SCHEMA_REGISTRY",
    "KafkaMessage",
    "PublishResult",
]

#: The outbox row's ``event_id`` (a UUID as text), on every record the relay sends (native
#: header style); the same on every re-send, so consumers deduplicate by it.
EVENT_ID_HEADER = "outbox-event-id"
EVENT_TYPE_HEADER = "outbox-event-type"
AGGREGATE_TYPE_HEADER = "outbox-aggregate-type"
AGGREGATE_ID_HEADER = "outbox-aggregate-id"
#: Headers the relay sets itself: an event may not carry them among its own.
RESERVED_HEADERS = frozenset(
    {EVENT_ID_HEADER, EVENT_TYPE_HEADER, AGGREGATE_TYPE_HEADER, AGGREGATE_ID_HEADER}
)


# Not frozen: a frozen dataclass's __init__ sets every field through object.__setattr__, and
# one message is made per event on the relay's hot path. Treat it as read-only.
@dataclass(slots=True)
class KafkaMessage:
    """An outbox row mapped to what Kafka receives."""

    topic: str
    key: bytes | None
    value: bytes | None
    # A None value is a header with a null value (Debezium mode sends them for NULL columns).
    headers: Sequence[tuple[str, bytes | None]]


#: The dependency a ``PublishResult`` names when the rows' schemas could not be loaded.
SCHEMA_REGISTRY = "Schema Registry"


@dataclass
class PublishResult:
    """Per-row outcome of one batch. Rows in no list were not sent (held back behind a failed
    row of their key, or not reached because Kafka became unavailable)."""

    delivered: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)  # retry with backoff
    rejected: list[tuple[int, str]] = field(default_factory=list)  # can never be sent
    unavailable: str | None = None  # Kafka trouble: back off before claiming again
    #: The dependency ``unavailable`` is about: "Kafka", or "Schema Registry" when the rows'
    #: schemas could not be loaded (the relay's outage log and ``/readyz`` name it).
    dependency: str = "Kafka"
    #: When the last record was handed to the producer (``time.monotonic_ns()``; None:
    #: none was): the stage log's "handed" (stagelog.py).
    handed_at: int | None = None
