"""The web framework examples (examples/fastapi, examples/aiohttp) served for real: uvicorn
in-process on a socket of its own, aiohttp's AppRunner on a TCP site. An HTTP request writes
an order and its event; the relay embedded in the app publishes it to a real Kafka topic.
With Kafka down, the app starts and serves all the same, and stops cleanly."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import asyncpg
import httpx
import pytest
import uvicorn
from aiohttp import web

from examples.aiohttp.app import RELAY
from examples.aiohttp.app import create_app as create_aiohttp_app
from examples.fastapi.app import create_app as create_fastapi_app
from notify_outbox import OutboxSettings, Relay
from tests.conftest import Services
from tests.support import address, consume, header, topic_total

pytestmark = pytest.mark.anyio


def make_settings(dsn: str, bootstrap: str) -> OutboxSettings:
    return OutboxSettings(
        dsn=dsn,
        kafka_bootstrap_servers=bootstrap,
        workers=2,
        poll_interval=30.0,  # long: delivery must not wait for the poll
    )


@asynccontextmanager
async def fastapi_served(settings: OutboxSettings, topic: str) -> AsyncIterator[tuple[str, Relay]]:
    """The FastAPI example under uvicorn, in this loop, on a listening socket of its own
    (connections wait in its backlog until the app has started: no polling). Yields the
    base URL and the app's relay; on exit, uvicorn shuts down (the lifespan stops the
    relay)."""
    app = create_fastapi_app(settings, topic=topic)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with httpx.AsyncClient(base_url=f"http://{address(sock)}", timeout=60) as client:
            # The first answer comes once the lifespan has started.
            assert (await client.get("/readyz")).status_code in (200, 503)
        yield f"http://{address(sock)}", app.state.relay
    finally:
        server.should_exit = True
        with anyio.fail_after(30):
            await serving
        sock.close()


@asynccontextmanager
async def aiohttp_served(settings: OutboxSettings, topic: str) -> AsyncIterator[tuple[str, Relay]]:
    """The aiohttp example on a TCP site of an AppRunner (``setup()`` runs its start-up, the
    cleanup_ctx that starts the relay). On exit, ``cleanup()`` stops the relay."""
    app = create_aiohttp_app(settings, topic=topic)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}", app[RELAY]
    finally:
        with anyio.fail_after(30):
            await runner.cleanup()


SERVED = {"fastapi": fastapi_served, "aiohttp": aiohttp_served}


async def post_order(base: str, customer: str, total_cents: int) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{base}/orders", json={"customer": customer, "total_cents": total_cents}
        ) as response,
    ):
        assert response.status == 201, await response.text()
        body: dict[str, Any] = await response.json()
        return body


async def readyz(base: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{base}/readyz") as response:
        return response.status


@pytest.mark.parametrize("framework", sorted(SERVED))
async def test_an_order_placed_over_http_arrives_in_kafka(
    framework: str, empty_db_dsn: str, services: Services, topic: str
) -> None:
    settings = make_settings(empty_db_dsn, services.bootstrap)
    async with SERVED[framework](settings, topic) as (base, relay):
        placed = await post_order(base, "ada", 1250)
        records, _ = await consume(services.bootstrap, topic, expect=1, within=60)
        assert relay.ready
        assert await readyz(base) == 200
    assert relay.outcome == "stopped"
    total = await topic_total(services.bootstrap, topic)  # the relay stopped
    assert total == 1
    (record,) = records
    order_id = placed["order_id"]
    assert json.loads(record.value or b"") == {
        "order_id": order_id,
        "customer": "ada",
        "total_cents": 1250,
    }
    assert record.key == f"order-{order_id}".encode()
    assert header(record, "outbox-event-id") == placed["event_id"]
    assert header(record, "outbox-event-type") == "OrderPlaced"
    # The order row and its event were written together; the event is marked published.
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        assert await conn.fetchval("SELECT customer FROM orders WHERE id = $1", order_id) == "ada"
        assert await conn.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
    finally:
        await conn.close()


@pytest.mark.parametrize("framework", sorted(SERVED))
async def test_the_app_starts_and_serves_while_kafka_is_down(
    framework: str, empty_db_dsn: str, topic: str, refusing: socket.socket
) -> None:
    settings = make_settings(empty_db_dsn, address(refusing))
    async with SERVED[framework](settings, topic) as (base, relay):
        # Started and serving, the relay still connecting: the order and its event are
        # written, and wait in the outbox.
        placed = await post_order(base, "grace", 990)
        assert await readyz(base) == 503
        assert not relay.ready
        assert relay.outcome == "running"
    # Shut down while Kafka never answered: the relay stops cleanly, the event stays pending.
    assert relay.outcome == "stopped"
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        pending = await conn.fetch("SELECT event_id::text FROM outbox WHERE published_at IS NULL")
    finally:
        await conn.close()
    assert [r["event_id"] for r in pending] == [placed["event_id"]]
