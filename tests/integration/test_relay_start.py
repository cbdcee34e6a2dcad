"""Starting an embedded relay while Kafka is down: what ``async with Relay(...)`` does (it
waits, and a cancelled wait stops the relay), and ``start_background()``, which never makes
the application's start wait. Real PostgreSQL; Kafka behind an address that refuses
connections until a forwarder starts listening on it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import asyncpg
import pytest

from notify_outbox import MigrationError, NotifyOutboxError, OutboxSettings, Relay, enqueue
from tests.conftest import Services
from tests.support import address, consume, logged, topic_total

pytestmark = pytest.mark.anyio


def make_settings(dsn: str, bootstrap: str, **kw: Any) -> OutboxSettings:
    return OutboxSettings(
        dsn=dsn,
        kafka_bootstrap_servers=bootstrap,
        workers=2,
        poll_interval=30.0,  # long: delivery must not wait for the poll
        kafka_send_timeout=5.0,
        **kw,
    )


def kafka_refused_seen() -> contextlib.AbstractContextManager[asyncio.Event]:
    """An event set when the publisher logs that Kafka is not reachable yet (its first
    failed attempt to start the producer)."""
    return logged("notify_outbox.publisher", "Kafka not reachable yet")


@contextlib.asynccontextmanager
async def forward(sock: socket.socket, to: str) -> AsyncIterator[None]:
    """Start listening on ``sock`` and forward every connection to ``to`` (host:port): Kafka
    comes up at that address. Only the bootstrap goes through here; the client then uses
    the broker's advertised address."""
    host, _, port = to.rpartition(":")
    writers: list[asyncio.StreamWriter] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        writers.append(up_writer)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, sock=sock)
    try:
        yield
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


async def test_async_with_waits_while_kafka_is_down_and_a_cancelled_wait_stops_the_relay(
    db_dsn: str, refusing: socket.socket
) -> None:
    relay = Relay(make_settings(db_dsn, address(refusing)))
    with kafka_refused_seen() as refused:
        enter = asyncio.create_task(relay.__aenter__())
        with anyio.fail_after(30):
            await refused.wait()
        # Still waiting: the application's start would be blocked here.
        assert not enter.done()
        assert not relay.ready
        assert relay.outcome == "running"
        # A timeout (or a shutdown) cancels the wait: the relay stops, nothing runs behind.
        enter.cancel()
        with anyio.fail_after(10), pytest.raises(asyncio.CancelledError):
            await enter
    assert relay.outcome == "stopped"
    assert relay.listener is None  # it never got as far as listening


async def test_background_start_returns_at_once_and_delivers_when_kafka_comes_up(
    db_dsn: str, services: Services, topic: str, refusing: socket.socket
) -> None:
    relay = Relay(make_settings(db_dsn, address(refusing), reconnect_max_delay=0.2))
    conn = await asyncpg.connect(db_dsn)
    try:
        with kafka_refused_seen() as refused:
            relay.start_background()  # returns at once: nothing to await
            assert not relay.ready
            with anyio.fail_after(30):
                await refused.wait()
        assert not relay.ready
        # The application works meanwhile: its events wait in the outbox.
        async with conn.transaction():
            await enqueue(conn, topic=topic, key="k", payload={"n": 1})
        async with forward(refusing, services.bootstrap):
            with anyio.fail_after(60):
                await relay.wait_ready()
            assert relay.ready
            records, _ = await consume(services.bootstrap, topic, expect=1, within=30)
            with anyio.fail_after(30):
                await relay.stop()
        total = await topic_total(services.bootstrap, topic)  # the relay stopped
    finally:
        await conn.close()
    assert [r.value for r in records] == [b'{"n": 1}']
    assert total == 1
    assert relay.outcome == "stopped"
    assert not relay.ready


async def test_background_start_stops_cleanly_while_kafka_never_answers(
    db_dsn: str, refusing: socket.socket
) -> None:
    relay = Relay(make_settings(db_dsn, address(refusing)))
    with kafka_refused_seen() as refused:
        relay.start_background()
        with anyio.fail_after(30):
            await refused.wait()
    waiting = asyncio.create_task(relay.wait_ready())
    with anyio.fail_after(10):
        await relay.stop()
    assert relay.outcome == "stopped"
    assert not relay.ready
    with pytest.raises(NotifyOutboxError, match="stopped before it was ready"):
        await waiting
    with pytest.raises(RuntimeError, match="started already"):
        relay.start_background()


async def test_background_start_reports_a_missing_outbox_at_once(
    empty_db_dsn: str, refusing: socket.socket, caplog: pytest.LogCaptureFixture
) -> None:
    relay = Relay(make_settings(empty_db_dsn, address(refusing)))
    with caplog.at_level(logging.ERROR, logger="notify_outbox.relay"):
        relay.start_background()
        with anyio.fail_after(30), pytest.raises(MigrationError, match="notify-outbox migrate"):
            await relay.wait_ready()
        with pytest.raises(MigrationError):
            await relay.stop()
    assert relay.outcome == "failed"
    assert not relay.ready
    assert any(r.getMessage().startswith("the relay stopped: outbox") for r in caplog.records), (
        caplog.text
    )
