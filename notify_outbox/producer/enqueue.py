"""The producer API: write events into the outbox inside the caller's transaction.

Events are validated before anything touches the database, so a wrong type, a payload that
is not JSON, a bad topic name or an oversized event raises ``EventValidationError`` here
instead of becoming a poison row for the relay.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import asyncpg

from notify_outbox.core.errors import EventValidationError
from notify_outbox.core.message import RESERVED_HEADERS
from notify_outbox.core.names import OutboxNames
from notify_outbox.core.tracing import with_trace_context
from notify_outbox.kafka.registry.serde import EventToCheck, SchemaCheck
from notify_outbox.pg.sqlfiles import Queries

__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "RESERVED_HEADERS",
    "OutboxEvent",
    "PreparedEvent",
    "enqueue",
    "enqueue_many",
    "prepare_events",
    "to_check",
]

# Kafka's default max.message.bytes is about 1 MiB; leave room for the record overhead.
DEFAULT_MAX_EVENT_BYTES = 1_000_000
_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")
_UNSET: Any = object()


@dataclass(frozen=True)
class OutboxEvent:
    """One event to publish. ``payload`` is any JSON value; ``value_bytes`` is raw bytes
    (Avro, Protobuf) instead of JSON. A ``key`` orders events: the same key arrives in
    commit order and lands on one partition."""

    topic: str
    payload: Any = _UNSET
    key: str | None = None
    headers: Mapping[str, str] | None = None
    value_bytes: bytes | None = None
    event_type: str | None = None
    aggregate_type: str | None = None
    aggregate_id: str | None = None
    idempotency_key: str | None = None


@dataclass(frozen=True)
class PreparedEvent:
    """An event checked and serialized, ready to be inserted."""

    event_id: uuid.UUID
    topic: str
    key: str | None
    payload_json: str | None
    value_bytes: bytes | None
    headers_json: str | None
    event_type: str | None
    aggregate_type: str | None
    aggregate_id: str | None
    idempotency_key: str | None


def _optional_str(value: object, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise EventValidationError(f"{what} must be a str or None, not {type(value).__name__}")
    return value


def _prepare(event: OutboxEvent, max_bytes: int) -> PreparedEvent:
    if not isinstance(event.topic, str) or not _TOPIC.fullmatch(event.topic):
        raise EventValidationError(
            f"topic must be 1-249 characters of letters, digits, '.', '_' or '-' "
            f"(got {event.topic!r})"
        )
    key = _optional_str(event.key, "key")
    payload_json: str | None = None
    if event.value_bytes is not None:
        if event.payload is not _UNSET:
            raise EventValidationError("give either payload or value_bytes, not both")
        if not isinstance(event.value_bytes, bytes | bytearray | memoryview):
            raise EventValidationError("value_bytes must be bytes")
        size = len(event.value_bytes)
    elif event.payload is not _UNSET:
        try:
            # Default separators match how PostgreSQL prints jsonb, so the size is honest.
            payload_json = json.dumps(event.payload, allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise EventValidationError(f"payload is not JSON-serializable: {e}") from None
        if "\x00" in payload_json:
            raise EventValidationError("payload contains a NUL character, which jsonb rejects")
        size = len(payload_json.encode())
    else:
        if key is None:
            raise EventValidationError("an event without payload (a tombstone) needs a key")
        size = 0
    headers_json: str | None = None
    # The active OpenTelemetry span's traceparent, when tracing is on (tracing.py).
    headers = with_trace_context(event.headers)
    if headers is not None:
        if not isinstance(headers, Mapping):
            raise EventValidationError("headers must be a mapping of str to str")
        for name, value in headers.items():
            if not isinstance(name, str) or not isinstance(value, str):
                raise EventValidationError("headers must be a mapping of str to str")
            if name in RESERVED_HEADERS:
                raise EventValidationError(f"header {name!r} is reserved for the relay")
            size += len(name.encode()) + len(value.encode())
        headers_json = json.dumps(dict(headers), ensure_ascii=False)
    size += len(key.encode()) if key else 0
    if size > max_bytes:
        raise EventValidationError(
            f"event is {size} bytes, over the limit of {max_bytes} bytes "
            "(Kafka rejects large messages; store large data elsewhere and send a reference)"
        )
    return PreparedEvent(
        event_id=uuid.uuid4(),
        topic=event.topic,
        key=key,
        payload_json=payload_json,
        value_bytes=bytes(event.value_bytes) if event.value_bytes is not None else None,
        headers_json=headers_json,
        event_type=_optional_str(event.event_type, "event_type"),
        aggregate_type=_optional_str(event.aggregate_type, "aggregate_type"),
        aggregate_id=_optional_str(event.aggregate_id, "aggregate_id"),
        idempotency_key=_optional_str(event.idempotency_key, "idempotency_key"),
    )


def prepare_events(
    events: Iterable[OutboxEvent], *, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
) -> list[PreparedEvent]:
    """Validate and serialize events, in the order given. Raises EventValidationError."""
    prepared = []
    for event in events:
        if not isinstance(event, OutboxEvent):
            raise EventValidationError(f"expected OutboxEvent, got {type(event).__name__}")
        prepared.append(_prepare(event, max_event_bytes))
    return prepared


def insertion_order(prepared: list[PreparedEvent]) -> list[PreparedEvent]:
    """Events sorted by key, stable within a key.

    The ordering trigger locks each key for the rest of the transaction; inserting keys in one
    global order keeps two concurrent multi-key transactions from deadlocking. Order within a
    key, the only order the outbox promises, is unchanged.
    """
    return sorted(prepared, key=lambda e: (e.key is not None, e.key or ""))


def to_check(events: Iterable[OutboxEvent]) -> list[EventToCheck]:
    """What a schema check (``schemas=``) sees of each event."""
    return [
        EventToCheck(
            topic=e.topic,
            event_type=e.event_type,
            payload=None if e.payload is _UNSET else e.payload,
            value_bytes=e.value_bytes,
            has_payload=e.payload is not _UNSET or e.value_bytes is not None,
        )
        for e in events
    ]


@cache
def _queries(names: OutboxNames) -> Queries:
    return Queries(names)


async def enqueue_many(
    conn: asyncpg.Connection,
    events: Iterable[OutboxEvent],
    *,
    names: OutboxNames | None = None,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    schemas: SchemaCheck | None = None,
) -> list[uuid.UUID]:
    """Insert events in one round trip; returns their event ids in the order given.

    Call it inside your transaction (``async with conn.transaction():``) so the events commit
    or roll back with your business change. ``schemas`` (``EventSchemas``, ``StaticSchema``
    from ``notify_outbox.schemaregistry``): each event must match its topic's schema, or
    ``SchemaMismatch`` (an ``EventValidationError``) is raised before anything is written.
    """
    events = list(events)
    prepared = prepare_events(events, max_event_bytes=max_event_bytes)
    if not prepared:
        return []
    if schemas is not None:
        await schemas.check_events(to_check(events))
    rows = insertion_order(prepared)
    await conn.execute(
        _queries(names or OutboxNames())["insert_events"],
        [e.event_id for e in rows],
        [e.topic for e in rows],
        [e.key for e in rows],
        [e.payload_json for e in rows],
        [e.value_bytes for e in rows],
        [e.headers_json for e in rows],
        [e.event_type for e in rows],
        [e.aggregate_type for e in rows],
        [e.aggregate_id for e in rows],
        [e.idempotency_key for e in rows],
    )
    return [e.event_id for e in prepared]


async def enqueue(
    conn: asyncpg.Connection,
    *,
    topic: str,
    payload: Any = _UNSET,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    value_bytes: bytes | None = None,
    event_type: str | None = None,
    aggregate_type: str | None = None,
    aggregate_id: str | None = None,
    idempotency_key: str | None = None,
    names: OutboxNames | None = None,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    schemas: SchemaCheck | None = None,
) -> uuid.UUID:
    """Insert one event in the caller's transaction and return its event id.

    The event id travels as the ``outbox-event-id`` Kafka header, the same on every re-send.
    """
    event = OutboxEvent(
        topic=topic,
        payload=payload,
        key=key,
        headers=headers,
        value_bytes=value_bytes,
        event_type=event_type,
        aggregate_type=aggregate_type,
        aggregate_id=aggregate_id,
        idempotency_key=idempotency_key,
    )
    (event_id,) = await enqueue_many(
        conn, [event], names=names, max_event_bytes=max_event_bytes, schemas=schemas
    )
    return event_id
