"""The producer API for SQLAlchemy ``Session`` and ``AsyncSession`` (extra: ``sqlalchemy``).

    from notify_outbox.sqlalchemy import enqueue
    with Session(engine) as session, session.begin():
        session.add(order)
        enqueue(session, topic="orders", key=str(order.id), payload={"total": 10})

The events are written through the session's own connection, so they commit or roll back
with the business change.

``outbox_tables`` declares the outbox's tables in your ``MetaData``, exactly as the
migrations create them: Alembic's autogenerate then proposes nothing for them (neither to
drop them nor to change them), and they can be queried with SQLAlchemy Core.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    TextClause,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP, UUID
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from notify_outbox.core.names import OutboxNames
from notify_outbox.kafka.registry.serde import SchemaCheck, StaticSchema

from .enqueue import (
    _UNSET,
    DEFAULT_MAX_EVENT_BYTES,
    OutboxEvent,
    PreparedEvent,
    insertion_order,
    prepare_events,
    to_check,
)

__all__ = [
    "OutboxTables",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
    "outbox_tables",
]


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
    schemas: StaticSchema | None = None,
) -> list[uuid.UUID]:
    """Write events through a sync ``Session``; returns their event ids in the order given.
    ``schemas``: a ``StaticSchema`` every event must match (a registry's ``EventSchemas``
    needs the async helpers)."""
    events = list(events)
    prepared = prepare_events(events, max_event_bytes=max_event_bytes)
    if prepared and schemas is not None:
        if not isinstance(schemas, StaticSchema):
            raise TypeError("the sync helpers take a StaticSchema: use enqueue_many_async")
        schemas.check_events_now(to_check(events))
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
    schemas: StaticSchema | None = None,
    **fields: Any,
) -> uuid.UUID:
    """Write one event through a sync ``Session`` (fields as in ``OutboxEvent``)."""
    event = _event(topic, payload, key, headers=headers, **fields)
    return enqueue_many(session, [event], names=names, schemas=schemas)[0]


async def enqueue_many_async(
    session: AsyncSession,
    events: Iterable[OutboxEvent],
    *,
    names: OutboxNames | None = None,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    schemas: SchemaCheck | None = None,
) -> list[uuid.UUID]:
    """Write events through an ``AsyncSession``; returns their event ids in the order given.
    ``schemas``: as in ``notify_outbox.enqueue_many``."""
    events = list(events)
    prepared = prepare_events(events, max_event_bytes=max_event_bytes)
    if prepared and schemas is not None:
        await schemas.check_events(to_check(events))
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
    schemas: SchemaCheck | None = None,
    **fields: Any,
) -> uuid.UUID:
    """Write one event through an ``AsyncSession`` (fields as in ``OutboxEvent``)."""
    event = _event(topic, payload, key, headers=headers, **fields)
    return (await enqueue_many_async(session, [event], names=names, schemas=schemas))[0]


@dataclass(frozen=True)
class OutboxTables:
    """The ``Table`` objects of one outbox (see ``outbox_tables``)."""

    outbox: Table
    dead_letter: Table
    config: Table
    #: The tracking table of ``notify-outbox migrate`` (shared by every outbox of a schema,
    #: and by the inbox's migrations).
    migrations: Table
    #: The exactly-once mode's slots and stamps (migration 0007).
    eos_slot: Table
    eos_stamp: Table


def _timestamptz() -> TIMESTAMP:
    return TIMESTAMP(timezone=True)


def _event_columns() -> list[Column[Any]]:
    """The columns the outbox and its dead-letter table share, after ``id``."""
    return [
        Column("topic", Text, nullable=False),
        Column("key", Text),
        Column("payload", JSONB),
        Column("payload_bytes", LargeBinary),
        Column("headers", JSONB),
        Column("event_type", Text),
        Column("aggregate_type", Text),
        Column("aggregate_id", Text),
        Column("idempotency_key", Text),
    ]


def outbox_tables(
    metadata: MetaData, names: OutboxNames | None = None, *, default_schema: str = "public"
) -> OutboxTables:
    """Declare the tables of one outbox in ``metadata``, as the shipped migrations create
    them (columns, types, defaults, keys, constraints and indexes), and return them.

    With them in your models' ``MetaData``, Alembic's autogenerate finds nothing to do for
    the outbox: it neither proposes to drop the tables (as it does for tables it does not
    know) nor to create them (``notify_outbox.alembic.upgrade_outbox`` does, with the
    triggers and functions that ``Table`` objects cannot express). Not declared: the
    autovacuum storage parameters, the triggers and the functions, which autogenerate does not
    compare. ``default_schema``: the schema your tables live in when they name none; an
    outbox there is declared without a schema, as autogenerate reflects it.

    Create the tables with the migrations, never with ``metadata.create_all()``: without the
    triggers, events would neither be ordered nor wake the relay.
    """
    names = names or OutboxNames()
    schema = None if names.schema == default_schema else names.schema
    t = names.table
    pending = "published_at IS NULL AND next_attempt_at IS NULL"
    waiting = "published_at IS NULL AND next_attempt_at IS NOT NULL"
    outbox = Table(
        t,
        metadata,
        Column("id", BigInteger, Identity(always=False), primary_key=True),
        Column(
            "event_id", UUID(as_uuid=True), nullable=False, server_default=text("gen_random_uuid()")
        ),
        *_event_columns(),
        Column("created_at", _timestamptz(), nullable=False, server_default=text("now()")),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("next_attempt_at", _timestamptz()),
        Column("last_error", Text),
        Column("published_at", _timestamptz()),
        CheckConstraint("topic ~ '^[A-Za-z0-9._-]{1,249}$'", name=f"{t}_topic_valid"),
        CheckConstraint("payload IS NULL OR payload_bytes IS NULL", name=f"{t}_one_payload"),
        CheckConstraint(
            "headers IS NULL OR jsonb_typeof(headers) = 'object'", name=f"{t}_headers_object"
        ),
        schema=schema,
    )
    c = outbox.c
    Index(
        f"{t}_published_idx",
        c.published_at,
        postgresql_where=text("published_at IS NOT NULL"),
    )
    Index(
        f"{t}_idempotency_key_idx",
        c.idempotency_key,
        unique=True,
        postgresql_where=text("idempotency_key IS NOT NULL"),
    )
    Index(f"{t}_fresh_idx", c.id, postgresql_where=text(pending))
    Index(f"{t}_waiting_key_idx", c.key, c.id, postgresql_where=text(waiting))
    Index(f"{t}_waiting_due_idx", c.next_attempt_at, postgresql_where=text(waiting))
    Index(
        f"{t}_bucket_idx",
        # Migration 0005's expression, spelt as PostgreSQL prints it back when SQLAlchemy
        # reflects the index (line breaks too): autogenerate compares the two texts.
        text(
            "(\nCASE\n"
            "    WHEN key IS NULL THEN (id & 255::bigint)::integer\n"
            "    ELSE hashtext(key) & 255\n"
            "END)"
        ),
        c.id,
        postgresql_where=text(pending),
    )
    dead_letter = Table(
        f"{t}_dead_letter",
        metadata,
        Column("id", BigInteger, primary_key=True, autoincrement=False),
        Column("event_id", UUID(as_uuid=True), nullable=False),
        *_event_columns(),
        Column("created_at", _timestamptz(), nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("error", Text, nullable=False),
        Column("dead_lettered_at", _timestamptz(), nullable=False, server_default=text("now()")),
        schema=schema,
    )
    config = Table(
        f"{t}_config",
        metadata,
        Column("singleton", Boolean, primary_key=True, server_default=text("true")),
        Column("notify_mode", Text, nullable=False, server_default=text("'gated'::text")),
        Column("awake_epoch_ms", Integer, nullable=False, server_default=text("25")),
        CheckConstraint("singleton", name=f"{t}_config_singleton_check"),
        CheckConstraint(
            "notify_mode IN ('gated', 'always', 'off')", name=f"{t}_config_notify_mode_check"
        ),
        CheckConstraint(
            "awake_epoch_ms BETWEEN 5 AND 60000", name=f"{t}_config_awake_epoch_ms_check"
        ),
        Column("delivery", Text, nullable=False, server_default=text("'at-least-once'::text")),
        CheckConstraint(
            "delivery IN ('at-least-once', 'exactly-once')", name=f"{t}_config_delivery_check"
        ),
        schema=schema,
    )
    eos_slot = Table(
        f"{t}_eos_slot",
        metadata,
        Column("slot", Integer, primary_key=True, autoincrement=False),
        Column("owner", Text),
        Column("expires_at", _timestamptz(), nullable=False, server_default=text("now()")),
        Column("seq", BigInteger, nullable=False, server_default=text("0")),
        CheckConstraint("slot >= 0", name=f"{t}_eos_slot_slot_check"),
        schema=schema,
    )
    eos_stamp = Table(
        f"{t}_eos_stamp",
        metadata,
        Column("id", BigInteger, primary_key=True, autoincrement=False),
        Column("key", Text),
        Column("slot", Integer, nullable=False),
        Column("seq", BigInteger, nullable=False),
        schema=schema,
    )
    Index(f"{t}_eos_stamp_key_idx", eos_stamp.c.key, postgresql_where=text("key IS NOT NULL"))
    Index(f"{t}_eos_stamp_slot_idx", eos_stamp.c.slot, eos_stamp.c.seq)
    # One tracking table per schema: a second outbox of the schema shares it.
    tracking = "notify_outbox_migrations"
    migrations = metadata.tables.get(f"{schema}.{tracking}" if schema else tracking)
    if migrations is None:
        migrations = Table(
            tracking,
            metadata,
            Column("target", Text, nullable=False),
            Column("version", Integer, nullable=False),
            Column("name", Text, nullable=False),
            Column("checksum", Text, nullable=False),
            Column("applied_at", _timestamptz(), nullable=False, server_default=text("now()")),
            PrimaryKeyConstraint("target", "version", name="notify_outbox_migrations_pkey"),
            schema=schema,
        )
    return OutboxTables(outbox, dead_letter, config, migrations, eos_slot, eos_stamp)
