"""The aiohttp order service.

``POST /orders`` writes the order and its ``OrderPlaced`` event in one asyncpg transaction
(``notify_outbox.enqueue``), so both commit or neither does. The relay runs in the same
process and event loop, started in a ``cleanup_ctx`` with ``start_background()``: the app
serves requests at once, even while Kafka is down (the events wait in the outbox), and the
same context stops the relay gracefully when the app shuts down. ``GET /readyz`` says whether
the relay delivers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
from aiohttp import web

from notify_outbox import EventValidationError, OutboxSettings, Relay, enqueue, load_settings
from notify_outbox import migrate as migrate_outbox

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    id          bigint  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer    text    NOT NULL,
    total_cents integer NOT NULL
)
"""

SETTINGS = web.AppKey("settings", OutboxSettings)
TOPIC = web.AppKey("topic", str)
POOL = web.AppKey("pool", asyncpg.Pool)
RELAY = web.AppKey("relay", Relay)


async def resources(app: web.Application) -> AsyncIterator[None]:
    """The database pool and the relay, for the app's lifetime (a ``cleanup_ctx``)."""
    settings = app[SETTINGS]
    pool = await asyncpg.create_pool(settings.dsn.get_secret_value(), min_size=1, max_size=4)
    try:
        async with pool.acquire() as conn:
            # Here for a self-contained example; a real service runs the outbox's migrations
            # as a deploy step (`notify-outbox migrate`, or an Alembic revision).
            await migrate_outbox(conn, settings.names)
            await conn.execute(SCHEMA)
        relay = Relay(settings)
        relay.start_background()  # returns at once: the app's start never waits for Kafka
        app[POOL] = pool
        app[RELAY] = relay
        try:
            yield
        finally:
            await relay.stop()  # graceful: in-flight batches finish
    finally:
        await pool.close()


async def place_order(request: web.Request) -> web.Response:
    """Write the order and its event in one transaction."""
    body = await request.json()
    customer, total_cents = body.get("customer"), body.get("total_cents")
    if not isinstance(customer, str) or not customer or not isinstance(total_cents, int):
        raise web.HTTPBadRequest(text="customer (a string) and total_cents (an integer)")
    async with request.app[POOL].acquire() as conn, conn.transaction():
        order_id: int = await conn.fetchval(
            "INSERT INTO orders (customer, total_cents) VALUES ($1, $2) RETURNING id",
            customer,
            total_cents,
        )
        try:
            event_id = await enqueue(
                conn,
                topic=request.app[TOPIC],
                key=f"order-{order_id}",  # one order's events stay in order
                payload={"order_id": order_id, "customer": customer, "total_cents": total_cents},
                event_type="OrderPlaced",
                aggregate_type="order",
                aggregate_id=str(order_id),
                names=request.app[SETTINGS].names,
            )
        except EventValidationError as e:  # raised before anything is written: rolls back
            raise web.HTTPBadRequest(text=str(e)) from None
    return web.json_response({"order_id": order_id, "event_id": str(event_id)}, status=201)


async def readyz(request: web.Request) -> web.Response:
    """200 while the relay delivers; 503 while it connects, or after an outage began."""
    relay = request.app[RELAY]
    return web.json_response(
        {"relay": "ready" if relay.ready else "not ready", "outcome": relay.outcome},
        status=200 if relay.ready else 503,
    )


def create_app(settings: OutboxSettings | None = None, *, topic: str = "orders") -> web.Application:
    """The app. ``settings``: the relay's (default: from ``NOTIFY_OUTBOX_*`` variables);
    its DSN is the app's database too. ``topic``: where order events go."""
    app = web.Application()
    app[SETTINGS] = settings or load_settings(OutboxSettings)
    app[TOPIC] = topic
    app.cleanup_ctx.append(resources)
    app.router.add_post("/orders", place_order)
    app.router.add_get("/readyz", readyz)
    return app
