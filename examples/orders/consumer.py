"""The consumer side: a billing service with its own database. Each ``OrderPlaced`` event
becomes one invoice, exactly once, however often Kafka delivers it: the inbox records the
event id in the same transaction as the invoice, and Kafka offsets are committed only after
that transaction."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer

from notify_outbox.inbox import Inbox, consume

# No unique constraint on order_id on purpose: the inbox is what keeps invoices single, and a
# double apply would be visible here.
SCHEMA = """
CREATE TABLE IF NOT EXISTS invoices (
    order_id     bigint      NOT NULL,
    customer     text        NOT NULL,
    amount_cents integer     NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
)
"""

inbox = Inbox(consumer="billing")


async def create_invoice(conn: asyncpg.Connection, message: Any) -> None:
    """The business change. Runs inside the inbox's transaction, only for a new event."""
    order = json.loads(message.value)
    await conn.execute(
        "INSERT INTO invoices (order_id, customer, amount_cents) VALUES ($1, $2, $3)",
        order["order_id"],
        order["customer"],
        order["total_cents"],
    )


async def run(bootstrap: str, pool: asyncpg.Pool, *, topic: str, group: str) -> None:
    """Consume ``topic`` in consumer group ``group`` until cancelled."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,  # offsets move only after the database commit
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        # consume subscribes the consumer to the topic with the inbox's rebalance listener,
        # which commits the batch in flight when partitions move to another consumer.
        await consume(consumer, pool, create_invoice, inbox=inbox, topics=[topic])
    finally:
        await consumer.stop()
