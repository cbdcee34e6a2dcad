"""The producer API for SQLAlchemy ``Session`` and ``AsyncSession`` (extra: ``sqlalchemy``).

    from notify_outbox.sqlalchemy import enqueue
    with Session(engine) as session, session.begin():
        session.add(order)
        enqueue(session, topic="orders", key=str(order.id), payload={"total": 10})

The events are written through the session's own connection, so they commit or roll back
with the business change.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from .enqueue import (
    _UNSET,
    DEFAULT_MAX_EVENT_BYTES,
    OutboxEvent,
    PreparedEvent,
    insertion_order,
    prepare_events,
)
from .names import OutboxNames

__all__ = ["enqueue", "enqueue_async", "enqueue_many", "enqueue_many_async"]


@cache
def _insert(names: OutboxNames) -> TextClause:
    # Named parameters work with every SQLAlchemy PostgreSQL driver (psycopg, asyncpg, ...);
    # a list of parameter sets runs as one batched executemany.
    return text(
        f"INSERT INTO {names.qualified_table} (event_id, topic, key, payload, payload_bytes, "
        "headers, event_type, aggregate_type, aggregate_id, idempotency_key) VALUES "
        "(CAST(:event_id AS uuid), :topic, :key, CAST(:payload AS jsonb), :payload_bytes, "
        "CAST(:headers AS jsonb), :event_type, :aggregate_type, :aggregate_id, "
        ":idempotency_key)"
    )


def _params(prepared: list[PreparedEvent]) -> list[dict[str, Any]]:
    return [
        {
            "event_id": str(e.event_id),
            "topic": e.topic,
            "key": e.key,
            "payload": e.payload_json,
            "payload_bytes": e.value_bytes,
            "headers": e.headers_json,
            "event_type": e.event_type,
            "aggregate_type": e.aggregate_type,
            "aggregate_id": e.aggregate_id,
            "idempotency_key": e.idempotency_key,
        }
        for e in insertion_order(prepared)
    ]


def _event(topic: str, payload: Any, key: str | None, **kw: Any) -> OutboxEvent:
    return OutboxEvent(topic=topic, payload=payload, key=key, **kw)


def enqueue_many(
    session: Session,
    events: Iterable[OutboxEvent],
    *,
    names: OutboxNames | None = None,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
) -> list[uuid.UUID]:
    """Write events through a sync ``Session``; returns their event ids in the order given."""
    prepared = prepare_events(events, max_event_bytes=max_event_bytes)
    if prepared:
        session.execute(_insert(names or OutboxNames()), _params(prepared))
    return [e.event_id for e in prepared]


def enqueue(
    session: Session,
    *,
    topic: str,
    payload: Any = _UNSET,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    names: OutboxNames | None = None,
    **fields: Any,
) -> uuid.UUID:
    """Write one event through a sync ``Session`` (fields as in ``OutboxEvent``)."""
    event = _event(topic, payload, key, headers=headers, **fields)
    return enqueue_many(session, [event], names=names)[0]


async def enqueue_many_async(
    session: AsyncSession,
    events: Iterable[OutboxEvent],
    *,
    names: OutboxNames | None = None,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
) -> list[uuid.UUID]:
    """Write events through an ``AsyncSession``; returns their event ids in the order given."""
    prepared = prepare_events(events, max_event_bytes=max_event_bytes)
    if prepared:
        await session.execute(_insert(names or OutboxNames()), _params(prepared))
    return [e.event_id for e in prepared]


async def enqueue_async(
    session: AsyncSession,
    *,
    topic: str,
    payload: Any = _UNSET,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    names: OutboxNames | None = None,
    **fields: Any,
) -> uuid.UUID:
    """Write one event through an ``AsyncSession`` (fields as in ``OutboxEvent``)."""
    event = _event(topic, payload, key, headers=headers, **fields)
    return (await enqueue_many_async(session, [event], names=names))[0]
