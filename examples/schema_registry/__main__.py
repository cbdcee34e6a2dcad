"""``python -m examples.schema_registry``: a topic governed by a Schema Registry, end to end.

1. Uses ``NOTIFY_OUTBOX_DSN``, ``NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS`` and
   ``NOTIFY_OUTBOX_SCHEMA_REGISTRY_URL`` when set; otherwise starts what is missing locally
   (``devstack``: PostgreSQL, Kafka, Apicurio Registry; no Docker).
2. Registers an Avro schema for the topic's values (``<topic>-value``).
3. A producer writes three orders through ``enqueue(..., schemas=EventSchemas(...))``; a
   fourth, missing its total, is refused before its transaction commits.
4. The relay (in this process) sends the three as Avro records in Confluent's wire format.
5. A consumer decodes them with ``RegistryDeserializer`` and prints them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from aiokafka import AIOKafkaConsumer

from devstack import Stack
from devstack.relayproc import create_topics
from devstack.schema_registry import SchemaRegistryServer
from notify_outbox import OutboxNames, OutboxSettings, Relay, enqueue, load_settings, migrate
from notify_outbox.schemaregistry import (
    EventSchemas,
    RegistryClient,
    RegistryDeserializer,
    SchemaMismatch,
)

ORDER_PLACED = {
    "type": "record",
    "name": "OrderPlaced",
    "namespace": "shop",
    "fields": [
        {"name": "order_id", "type": "string"},
        {"name": "customer", "type": "string"},
        {"name": "total_cents", "type": "long"},
    ],
}


@contextlib.contextmanager
def services() -> Iterator[tuple[str, str, str]]:
    """(dsn, bootstrap, registry url): from the environment, or started here."""
    dsn = os.environ.get("NOTIFY_OUTBOX_DSN")
    bootstrap = os.environ.get("NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS")
    url = os.environ.get("NOTIFY_OUTBOX_SCHEMA_REGISTRY_URL")
    with contextlib.ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sr-example-")))
        if not (dsn and bootstrap):
            print("starting PostgreSQL and Kafka (devstack)...", flush=True)
            local = stack.enter_context(Stack(base / "stack"))
            dsn, bootstrap = local.postgres.dsn, local.kafka.bootstrap_servers
        if not url:
            print("starting a Schema Registry (Apicurio, devstack)...", flush=True)
            registry = SchemaRegistryServer(base / "registry")
            registry.start()
            stack.callback(registry.stop)
            url = registry.url
        yield dsn, bootstrap, url


async def main(admin_dsn: str, bootstrap: str, url: str) -> None:
    """Steps 2-5, in a database of its own on the server of ``admin_dsn``."""
    name = f"sr_example_{uuid.uuid4().hex[:6]}"
    admin = await asyncpg.connect(admin_dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        await scenario(urlunsplit(urlsplit(admin_dsn)._replace(path=f"/{name}")), bootstrap, url)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def scenario(dsn: str, bootstrap: str, url: str) -> None:
    topic = f"orders-{uuid.uuid4().hex[:6]}"
    await create_topics(bootstrap, [topic], partitions=1)
    conn = await asyncpg.connect(dsn)
    client = RegistryClient(url)
    try:
        await migrate(conn, OutboxNames())
        schema_id = await client.register(f"{topic}-value", json.dumps(ORDER_PLACED))
        print(f"registered {topic}-value: schema id {schema_id}")
        schemas = EventSchemas(client)
        for i, (customer, total) in enumerate([("ada", 1250), ("grace", 990), ("ada", 4100)]):
            async with conn.transaction():
                await enqueue(
                    conn,
                    topic=topic,
                    key=customer,
                    payload={"order_id": f"o-{i}", "customer": customer, "total_cents": total},
                    schemas=schemas,
                )
        try:
            async with conn.transaction():
                await enqueue(
                    conn, topic=topic, payload={"order_id": "o-3", "customer": "x"}, schemas=schemas
                )
        except SchemaMismatch as e:
            print(f"refused before the commit: {e}")
        settings = load_settings(
            OutboxSettings, dsn=dsn, kafka_bootstrap_servers=bootstrap, schema_registry_url=url
        )
        consumer = AIOKafkaConsumer(
            topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest"
        )
        decode = RegistryDeserializer(client)
        async with Relay(settings):
            await consumer.start()
            try:
                received = 0
                async with asyncio.timeout(60):
                    async for record in consumer:
                        size = len(record.value or b"")
                        print(f"received ({size} bytes): {await decode(record.value)}")
                        received += 1
                        if received == 3:
                            break
            finally:
                await consumer.stop()
        print("example: OK")
    finally:
        await client.aclose()
        await conn.close()


if __name__ == "__main__":
    with services() as (dsn, bootstrap, url):
        asyncio.run(main(dsn, bootstrap, url))
