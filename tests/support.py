"""Helpers shared by the integration tests: DSNs, consuming, and (from ``devstack.relayproc``,
shared with the bench and the demo) topics and the relay CLI as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import urllib.request
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from devstack.relayproc import ROOT, RelayProcess, create_topics

__all__ = [
    "ROOT",
    "RelayProcess",
    "address",
    "consume",
    "create_topics",
    "dsn_with_database",
    "dsn_with_user",
    "header",
    "logged",
    "metric",
    "topic_total",
]


def address(sock: socket.socket) -> str:
    """The host:port a bound socket has."""
    host, port = sock.getsockname()
    return f"{host}:{port}"


def dsn_with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path=f"/{database}"))


def dsn_with_user(dsn: str, user: str, password: str) -> str:
    parts = urlsplit(dsn)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{user}:{password}@{host}:{parts.port}" if parts.port else f"{user}:{password}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


async def consume(
    bootstrap: str,
    topic: str,
    *,
    expect: int,
    within: float = 60.0,
    client: Mapping[str, Any] | None = None,
) -> tuple[list[ConsumerRecord[bytes, bytes]], int]:
    """Read ``topic`` from the beginning until ``expect`` messages arrived (or fail after
    ``within`` seconds). Returns the messages (per partition in offset order) and the total number
    of messages the topic holds right now, from its end offsets. That total proves nothing extra
    was published only once nothing can publish to the topic any more: while a relay still
    runs, a late duplicate may come after it was read. Tests that check for duplicates count
    with ``topic_total`` after the relay stopped. ``client``: more consumer
    arguments (TLS, SASL)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **(client or {}),
    )
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic)
        if partitions is None:
            await consumer._client.force_metadata_update()
            partitions = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        records: list[ConsumerRecord[bytes, bytes]] = []
        with anyio.fail_after(within):
            while len(records) < expect:
                batch = await consumer.getmany(*tps, timeout_ms=200)
                for tp_records in batch.values():
                    records.extend(tp_records)
        ends = await consumer.end_offsets(tps)
        return records, sum(ends.values())
    finally:
        await consumer.stop()


async def topic_total(bootstrap: str, topic: str) -> int:
    """The number of messages ``topic`` holds, from its end offsets (re-read on each call).
    Called once whatever publishes to the topic has stopped (a relay stopped, its process
    exited), it counts every copy that was sent, late duplicates included."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic)
        if partitions is None:
            await consumer._client.force_metadata_update()
            partitions = consumer.partitions_for_topic(topic) or set()
        ends = await consumer.end_offsets([TopicPartition(topic, p) for p in partitions])
        return sum(ends.values())
    finally:
        await consumer.stop()


def header(record: ConsumerRecord[bytes, bytes], name: str) -> str | None:
    for key, value in record.headers or ():
        if key == name:
            return value.decode()
    return None


def metric(port: int, sample: str, **labels: str) -> float:
    """The sum of a relay's ``sample`` (e.g. ``notify_outbox_published_total``) over the
    samples that carry ``labels``, read from its /metrics on ``port`` (NOTIFY_OUTBOX_HTTP_PORT):
    what the relay itself counted, for tests that need to know what one process did."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


@contextlib.contextmanager
def logged(logger: str, text: str) -> Iterator[asyncio.Event]:
    """An event set when ``logger`` (or a child) writes a record whose message contains
    ``text``: a log line of the code under test, waited on as an event."""
    seen = asyncio.Event()

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                seen.set()

    handler = Handler()
    logging.getLogger(logger).addHandler(handler)
    try:
        yield seen
    finally:
        logging.getLogger(logger).removeHandler(handler)


@contextlib.contextmanager
def http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` serving on a loopback port of its own, in a thread; yields its base URL
    (``http://127.0.0.1:PORT``). For stand-ins of HTTP services a test needs to misbehave
    (a registry refusing credentials, an identity provider)."""
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
