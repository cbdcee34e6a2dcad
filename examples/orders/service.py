"""The producer side: an order service. Each order and its ``OrderPlaced`` event are written in
one transaction, so the event exists exactly when the order does."""

from __future__ import annotations

import asyncpg

import notify_outbox

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer    text        NOT NULL,
    total_cents integer     NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
)
"""


async def place_order(
    conn: asyncpg.Connection, *, customer: str, total_cents: int, topic: str = "orders"
) -> int:
    """Insert an order and its event in one transaction; returns the order id."""
    async with conn.transaction():
        order_id: int = await conn.fetchval(
            "INSERT INTO orders (customer, total_cents) VALUES ($1, $2) RETURNING id",
            customer,
            total_cents,
        )
        await notify_outbox.enqueue(
            conn,
            topic=topic,
            key=f"order-{order_id}",  # one order's events stay in order
            payload={"order_id": order_id, "customer": customer, "total_cents": total_cents},
            event_type="OrderPlaced",
            aggregate_type="order",
            aggregate_id=str(order_id),
        )
    return order_id
