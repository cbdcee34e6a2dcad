"""The FastAPI order service.

``POST /orders`` writes the order (an ORM row) and its ``OrderPlaced`` event in one
transaction of an ``AsyncSession``: ``notify_outbox.producer.sqlalchemy.enqueue_async`` inserts the
event through the session's own connection, so both commit or neither does. The relay runs in
the same process and event loop, started in the lifespan with ``start_background()``: the app
serves requests at once, even while Kafka is down (the events wait in the outbox), and
``GET /readyz`` says whether the relay delivers.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations at
# runtime.
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import asyncpg
from fastapi import Depends, FastAPI, Request, Response
from pydantic import BaseModel, Field
from sqlalchemy import BigInteger, Integer, Text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from notify_outbox import OutboxSettings, Relay, load_settings, migrate
from notify_outbox.producer.sqlalchemy import enqueue_async


class Base(DeclarativeBase):
    """The service's models."""


class Order(Base):
    """One order: the business row written with its event."""

    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    customer: Mapped[str] = mapped_column(Text)
    total_cents: Mapped[int] = mapped_column(Integer)


class OrderIn(BaseModel):
    """What ``POST /orders`` takes."""

    customer: str = Field(min_length=1)
    total_cents: int = Field(gt=0)


class OrderOut(BaseModel):
    """What ``POST /orders`` answers: the order's id and its event's id (the
    ``outbox-event-id`` header of the Kafka message)."""

    order_id: int
    event_id: str


def sqlalchemy_url(settings: OutboxSettings) -> str:
    """The relay's DSN for SQLAlchemy's asyncpg dialect."""
    dsn = settings.dsn.get_secret_value()
    return "postgresql+asyncpg://" + dsn.split("://", 1)[1]


async def prepare_database(settings: OutboxSettings) -> None:
    """The outbox's migrations (idempotent). Here for a self-contained example; a real
    service runs them as a deploy step: ``notify-outbox migrate``, or
    ``notify_outbox.producer.alembic.upgrade_outbox(op)`` in an Alembic revision."""
    conn = await asyncpg.connect(settings.dsn.get_secret_value())
    try:
        await migrate(conn, settings.names)
    finally:
        await conn.close()


async def session(request: Request) -> AsyncIterator[AsyncSession]:
    """A session per request (a FastAPI dependency)."""
    sessions: async_sessionmaker[AsyncSession] = request.app.state.sessions
    async with sessions() as s:
        yield s


def create_app(settings: OutboxSettings | None = None, *, topic: str = "orders") -> FastAPI:
    """The app. ``settings``: the relay's (default: from ``NOTIFY_OUTBOX_*`` variables);
    its DSN is the app's database too. ``topic``: where order events go."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        s = settings or load_settings(OutboxSettings)
        await prepare_database(s)
        engine = create_async_engine(sqlalchemy_url(s))
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)  # the example's own table
        relay = Relay(s)
        relay.start_background()  # returns at once: the app's start never waits for Kafka
        app.state.relay = relay
        app.state.sessions = async_sessionmaker(engine, expire_on_commit=False)
        try:
            yield
        finally:
            try:
                await relay.stop()  # graceful: in-flight batches finish
            finally:
                await engine.dispose()

    app = FastAPI(title="orders (notify-outbox example)", lifespan=lifespan)

    @app.post("/orders", status_code=201)
    async def place_order(
        order: OrderIn, db: Annotated[AsyncSession, Depends(session)]
    ) -> OrderOut:
        """Write the order and its event in one transaction."""
        async with db.begin():
            row = Order(customer=order.customer, total_cents=order.total_cents)
            db.add(row)
            await db.flush()  # the order's id, for the event
            event_id = await enqueue_async(
                db,
                topic=topic,
                key=f"order-{row.id}",  # one order's events stay in order
                payload={
                    "order_id": row.id,
                    "customer": row.customer,
                    "total_cents": row.total_cents,
                },
                event_type="OrderPlaced",
                aggregate_type="order",
                aggregate_id=str(row.id),
            )
        return OrderOut(order_id=row.id, event_id=str(event_id))

    @app.get("/readyz")
    async def readyz(request: Request, response: Response) -> dict[str, Any]:
        """200 while the relay delivers; 503 while it connects, or after an outage began."""
        relay: Relay = request.app.state.relay
        if not relay.ready:
            response.status_code = 503
        return {"relay": "ready" if relay.ready else "not ready", "outcome": relay.outcome}

    return app
