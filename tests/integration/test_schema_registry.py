"""Topics governed by a Schema Registry (issue #33, part 2), against a real registry (Apicurio
Registry's Confluent-compatible API), PostgreSQL and Kafka: the relay encodes JSON events in
Confluent's wire format (read back with confluent-kafka's own deserializers), producers are
refused a bad event before their commit, a plain-SQL bad row is dead-lettered at once, a
subject registered late is picked up, and a registry outage only makes rows wait.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
from aiokafka import ConsumerRecord
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from devstack.certs import CertificateAuthority
from devstack.schema_registry import SchemaRegistryServer
from notify_outbox import OutboxSettings, Relay, enqueue
from notify_outbox.core.errors import ConfigurationError
from notify_outbox.inbox import Inbox, consume_batches
from notify_outbox.ops.metrics import RelayMetrics
from notify_outbox.relay.exactly_once import ExactlyOnceRelay
from notify_outbox.schemaregistry import (
    EventSchemas,
    RegistryClient,
    RegistryDeserializer,
    SchemaIncompatible,
    SchemaMismatch,
    frame,
    unframe,
)
from tests.conftest import Services
from tests.faults.harness import eventually
from tests.integration.test_inbox_batch import group_consumer, pool, until_committed
from tests.support import consume, http_server, logged
from tests.unit.test_protobuf_codec import message_class

pytestmark = pytest.mark.anyio

__all__ = ["pool"]  # the inbox's fixture, used here

ORDER = {
    "type": "record",
    "name": "OrderPlaced",
    "namespace": "acme",
    "fields": [
        {"name": "order", "type": "long"},
        {"name": "total", "type": "double"},
        {"name": "note", "type": ["null", "string"], "default": None},
    ],
}
ORDER_JSON_SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {"order": {"type": "integer"}, "total": {"type": "number"}},
    "required": ["order", "total"],
}


# A row that does not match ORDER (no total), its key's next row, and another key's row.
BAD_THEN_GOOD = (
    "INSERT INTO outbox (topic, key, payload) VALUES "
    "($1, 'bad', '{\"order\": 1}'), "
    "($1, 'bad', '{\"order\": 2, \"total\": 2.0}'), "
    "($1, 'good', '{\"order\": 3, \"total\": 3.0}')"
)


def relay_settings(db_dsn: str, services: Services, url: str, **kw: Any) -> OutboxSettings:
    fields: dict[str, Any] = {
        "dsn": db_dsn,
        "kafka_bootstrap_servers": services.bootstrap,
        "schema_registry_url": url,
        "workers": 2,
        "poll_interval": 0.2,
        "retry_base_delay": 0.05,
        "retry_max_delay": 0.2,
    }
    fields.update(kw)
    return OutboxSettings(**fields)


@pytest.fixture
async def registry(schema_registry: SchemaRegistryServer) -> AsyncIterator[RegistryClient]:
    client = RegistryClient(schema_registry.url)
    yield client
    await client.aclose()


@pytest.fixture
def confluent(schema_registry: SchemaRegistryServer) -> Iterator[SchemaRegistryClient]:
    """confluent-kafka's own registry client, for its deserializers."""
    with SchemaRegistryClient({"url": schema_registry.url}) as client:
        yield client


async def relay_sql(
    db_dsn: str, services: Services, url: str, topic: str, sql: str, expect: int
) -> list[ConsumerRecord[bytes, bytes]]:
    """Run a relay (on registry ``url``), write rows with ``sql`` ($1: the topic), and return
    the ``expect`` records that reach ``topic``."""
    conn = await asyncpg.connect(db_dsn)
    try:
        with anyio.fail_after(60):
            async with Relay(relay_settings(db_dsn, services, url)):
                await conn.execute(sql, topic)
                records, _ = await consume(services.bootstrap, topic, expect=expect)
    finally:
        await conn.close()
    return records


async def test_the_relay_sends_avro_records_that_confluent_deserializers_read(
    db_dsn: str,
    services: Services,
    topic: str,
    schema_registry: SchemaRegistryServer,
    registry: RegistryClient,
    confluent: SchemaRegistryClient,
) -> None:
    """Events checked by the producer against the topic's subject, encoded by the relay with
    it: each record is magic byte 0, the registered id, the Avro body; confluent-kafka's
    AvroDeserializer reads every event back as written, each key's in commit order."""
    schema_id = await registry.register(f"{topic}-value", json.dumps(ORDER))
    schemas = EventSchemas(registry)
    events: list[dict[str, Any]] = [
        {"order": n, "total": n * 1.5, "note": None if n % 2 else f"n{n}"} for n in range(60)
    ]
    conn = await asyncpg.connect(db_dsn)
    try:
        with anyio.fail_after(60):
            async with Relay(relay_settings(db_dsn, services, schema_registry.url)):
                for n, event in enumerate(events):
                    async with conn.transaction():
                        await enqueue(
                            conn,
                            topic=topic,
                            key=f"k{n % 3}",
                            payload=event,
                            schemas=schemas,
                        )
                records, total = await consume(services.bootstrap, topic, expect=len(events))
    finally:
        await conn.close()
    assert total == len(events)
    deserialize = AvroDeserializer(confluent)
    per_key: dict[bytes | None, list[dict[str, Any]]] = collections.defaultdict(list)
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        assert record.value is not None
        assert unframe(record.value)[0] == schema_id
        value = deserialize(record.value, SerializationContext(topic, MessageField.VALUE))
        per_key[record.key].append(value)
    for key, values in per_key.items():
        orders = [v["order"] for v in values]
        assert orders == sorted(orders), f"key {key!r} out of order"
    decoded = sorted((v for vs in per_key.values() for v in vs), key=lambda v: v["order"])
    assert decoded == events


async def test_json_schema_topics_carry_the_json_text_behind_the_schema_id(
    db_dsn: str,
    services: Services,
    topic: str,
    schema_registry: SchemaRegistryServer,
    registry: RegistryClient,
    confluent: SchemaRegistryClient,
) -> None:
    """A JSON Schema subject: the record is the prefix and the event's JSON, which
    confluent-kafka's JSONDeserializer and this library's RegistryDeserializer both read."""
    schema_id = await registry.register(
        f"{topic}-value", json.dumps(ORDER_JSON_SCHEMA), schema_type="JSON"
    )
    records = await relay_sql(
        db_dsn,
        services,
        schema_registry.url,
        topic,
        "INSERT INTO outbox (topic, key, payload) SELECT $1, 'k', "
        "jsonb_build_object('order', n, 'total', n * 2) FROM generate_series(1, 5) n",
        expect=5,
    )
    ours = RegistryDeserializer(registry)
    theirs = JSONDeserializer(None, schema_registry_client=confluent)
    values = []
    for record in sorted(records, key=lambda r: r.offset):
        assert record.value is not None
        assert unframe(record.value)[0] == schema_id
        value = await ours(record.value)
        assert theirs(record.value, SerializationContext(topic, MessageField.VALUE)) == value
        values.append(value)
    assert values == [{"order": n, "total": n * 2} for n in range(1, 6)]


async def test_a_producer_is_refused_an_event_that_does_not_match_before_its_commit(
    db_dsn: str, topic: str, registry: RegistryClient
) -> None:
    """``schemas=``: a missing field, a wrong type, a field the schema does not have, an
    event of a topic with no subject: each raises SchemaMismatch naming the problem, and the
    transaction writes nothing."""
    await registry.register(f"{topic}-value", json.dumps(ORDER))
    schemas = EventSchemas(registry)
    conn = await asyncpg.connect(db_dsn)
    try:
        for payload, expected in [
            ({"order": 1}, "total"),
            ({"order": "one", "total": 1.0}, "order"),
            ({"order": 1, "total": 1.0, "extra": 1}, "extra"),
        ]:
            with pytest.raises(SchemaMismatch, match=expected):
                async with conn.transaction():
                    await enqueue(conn, topic=topic, payload=payload, schemas=schemas)
        with pytest.raises(SchemaMismatch, match="no schema registered under subject"):
            await enqueue(conn, topic=f"{topic}-none", payload={}, schemas=schemas)
        async with conn.transaction():
            await enqueue(conn, topic=topic, payload={"order": 1, "total": 2.0}, schemas=schemas)
        assert await conn.fetchval("SELECT count(*) FROM outbox") == 1
    finally:
        await conn.close()


async def test_a_plain_sql_row_that_does_not_match_is_dead_lettered_at_once(
    db_dsn: str,
    services: Services,
    topic: str,
    schema_registry: SchemaRegistryServer,
    registry: RegistryClient,
    confluent: SchemaRegistryClient,
) -> None:
    """A row written by plain SQL that does not match its subject's schema is dead-lettered
    at its first attempt with the reason (it will never match); its key's later row is held
    behind it, then sent; other keys flow."""
    await registry.register(f"{topic}-value", json.dumps(ORDER))
    conn = await asyncpg.connect(db_dsn)
    try:
        with anyio.fail_after(60):
            async with Relay(
                relay_settings(db_dsn, services, schema_registry.url, max_attempts=5)
            ) as relay:
                await conn.execute(BAD_THEN_GOOD, topic)
                await relay.events.wait_for("dead_lettered", 1)
                records, _ = await consume(services.bootstrap, topic, expect=2)
            dead = await conn.fetch("SELECT key, error, attempts FROM outbox_dead_letter")
    finally:
        await conn.close()
    assert [(d["key"], d["attempts"]) for d in dead] == [("bad", 1)]
    assert "schema" in dead[0]["error"]
    assert "total" in dead[0]["error"]
    deserialize = AvroDeserializer(confluent)
    sent = {
        r.key: deserialize(r.value, SerializationContext(topic, MessageField.VALUE))["order"]
        for r in records
    }
    assert sent == {b"bad": 2, b"good": 3}


async def test_a_subject_registered_after_its_first_event_is_picked_up(
    db_dsn: str,
    services: Services,
    topic: str,
    schema_registry: SchemaRegistryServer,
    registry: RegistryClient,
) -> None:
    """A row of a governed topic whose subject has no schema yet fails with the reason and
    is retried (not dead-lettered while attempts remain); once the schema is registered, the
    row goes out encoded with it."""
    conn = await asyncpg.connect(db_dsn)
    try:
        with anyio.fail_after(60):
            async with Relay(
                relay_settings(db_dsn, services, schema_registry.url, max_attempts=1000)
            ) as relay:
                await conn.execute(
                    "INSERT INTO outbox (topic, key, payload) "
                    "VALUES ($1, 'k', '{\"order\": 7, \"total\": 1.0}')",
                    topic,
                )
                await relay.events.wait_for("retried", 1)
                error = await conn.fetchval("SELECT last_error FROM outbox")
                schema_id = await registry.register(f"{topic}-value", json.dumps(ORDER))
                records, _ = await consume(services.bootstrap, topic, expect=1)
    finally:
        await conn.close()
    assert f"no schema registered under subject '{topic}-value'" in error
    assert records[0].value is not None
    assert unframe(records[0].value)[0] == schema_id


async def test_the_registry_down_rows_wait_uncounted_and_flow_once_it_answers(
    db_dsn: str,
    services: Services,
    topic: str,
    schema_registry: SchemaRegistryServer,
    registry: RegistryClient,
) -> None:
    """The registry stops while the relay runs, and a row comes for a subject the relay has
    not loaded yet: one outage line naming the registry (as does ``/readyz``), the row stays
    pending with no attempt counted; when the registry is back (its schemas kept), the row
    goes out."""
    await registry.register(f"{topic}-value", json.dumps(ORDER))
    conn = await asyncpg.connect(db_dsn)
    try:
        with anyio.fail_after(120):
            async with Relay(relay_settings(db_dsn, services, schema_registry.url)) as relay:
                with (
                    logged("notify_outbox", "Schema Registry at") as outage,
                    logged("notify_outbox.relay", "Schema Registry unavailable (") as named,
                ):
                    schema_registry.stop()
                    try:
                        await conn.execute(
                            "INSERT INTO outbox (topic, key, payload) "
                            "VALUES ($1, 'k', '{\"order\": 1, \"total\": 1.0}')",
                            topic,
                        )
                        await outage.wait()
                        await relay.events.wait_for("kafka_unavailable", 1)
                        readiness = RelayMetrics(relay).readiness()
                        row = await conn.fetchrow("SELECT attempts, published_at FROM outbox")
                    finally:
                        await asyncio.to_thread(schema_registry.start)
                answered = time.monotonic()
                records, _ = await consume(services.bootstrap, topic, expect=1)
                back = time.monotonic() - answered
    finally:
        await conn.close()
    assert named.is_set()
    assert readiness.reason == "schema_registry: unavailable (does not answer)"
    assert row is not None
    assert row["attempts"] == 0
    assert row["published_at"] is None
    assert records[0].value is not None
    assert records[0].value[0] == 0
    # Recovery probes back off up to 0.2 s; consuming adds a consumer's start.
    assert back < 10, f"the row came {back:.1f}s after the registry answered"


async def test_an_incompatible_schema_is_refused_at_registration(registry: RegistryClient) -> None:
    """BACKWARD compatibility (the test registry's, as Confluent's default): a new required
    field without a default is refused with a clear error."""
    subject = f"c-{uuid.uuid4().hex[:8]}-value"
    await registry.register(subject, json.dumps(ORDER))
    changed = {**ORDER, "fields": [*ORDER["fields"], {"name": "currency", "type": "string"}]}
    with pytest.raises(SchemaIncompatible, match=r"refused the schema \(HTTP 409"):
        await registry.register(subject, json.dumps(changed))


async def test_the_inbox_loop_decodes_registry_records(
    pool: asyncpg.Pool,
    db_dsn: str,
    services: Services,
    topic: str,
    schema_registry: SchemaRegistryServer,
    registry: RegistryClient,
) -> None:
    """``consume_batches(deserializer=RegistryDeserializer(...))``: the handler sees each
    event's decoded value; the inbox still deduplicates by the relay's event id header."""
    await registry.register(f"{topic}-value", json.dumps(ORDER))
    await relay_sql(
        db_dsn,
        services,
        schema_registry.url,
        topic,
        "INSERT INTO outbox (topic, key, payload) SELECT $1, 'k' || (n % 3), "
        "jsonb_build_object('order', n, 'total', 1.0) FROM generate_series(1, 20) n",
        expect=20,
    )
    seen: list[dict[str, Any]] = []

    async def handler(conn: asyncpg.Connection, messages: list[Any]) -> None:
        seen.extend(m.value for m in messages)

    consumer = group_consumer(services, topic)
    await consumer.start()
    try:
        loop = consume_batches(
            consumer,
            pool,
            handler,
            inbox=Inbox(consumer="decoding"),
            deserializer=RegistryDeserializer(registry),
        )
        await until_committed(consumer, topic, loop)
    finally:
        await consumer.stop()
    assert sorted(v["order"] for v in seen) == list(range(1, 21))
    assert all(v["total"] == 1.0 and v["note"] is None for v in seen)


class _Refusing(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"error_code": 40101, "message": "Unauthorized"}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def refusing_registry() -> Iterator[str]:
    """An HTTP server on loopback that answers every request 401 (wrong credentials)."""
    with http_server(_Refusing) as url:
        yield url


async def test_a_registry_that_refuses_the_credentials_stops_the_start(
    db_dsn: str, services: Services, refusing_registry: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Wrong registry credentials are a setting to fix: the relay's start raises
    ConfigurationError naming the registry and the settings to check, never the password."""
    settings = relay_settings(
        db_dsn,
        services,
        refusing_registry,
        schema_registry_username="relay",
        schema_registry_password="s3cret-pw",
    )
    with anyio.fail_after(60), pytest.raises(ConfigurationError) as raised:
        await Relay(settings).run()
    message = str(raised.value)
    assert "refused the client (HTTP 401" in message
    assert "SCHEMA_REGISTRY_USERNAME" in message
    assert "s3cret-pw" not in message
    assert "s3cret-pw" not in caplog.text


def order_placed_message() -> Any:
    """A Protobuf message class ``shop.OrderPlaced`` built at run time (no protoc here)."""
    fdp = descriptor_pb2.FileDescriptorProto(
        name=f"shop/order_{uuid.uuid4().hex[:6]}.proto", package="shop", syntax="proto3"
    )
    message = fdp.message_type.add(name="OrderPlaced")
    field = descriptor_pb2.FieldDescriptorProto
    message.field.add(name="order_id", number=1, type=field.TYPE_STRING)
    message.field.add(name="total_cents", number=2, type=field.TYPE_INT64)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.OrderPlaced"))


async def test_protobuf_events_encoded_by_the_producer_go_out_as_written(
    db_dsn: str,
    services: Services,
    topic: str,
    schema_registry: SchemaRegistryServer,
    registry: RegistryClient,
    confluent: SchemaRegistryClient,
) -> None:
    """Protobuf: the producer encodes with confluent-kafka's ProtobufSerializer (which
    registers the schema) and writes value_bytes; the producer check and the relay accept
    them because their id is registered under the topic's subject, the relay sends them
    unchanged, and ProtobufDeserializer reads them. Bytes carrying another subject's id are
    refused by the producer check and dead-lettered by the relay (written by plain SQL)."""
    order = order_placed_message()
    context = SerializationContext(topic, MessageField.VALUE)
    serialize = ProtobufSerializer(order, confluent, {"use.deprecated.format": False})
    encoded = [serialize(order(order_id=f"o-{n}", total_cents=100 * n), context) for n in range(5)]
    other = await registry.register(f"{topic}-other", json.dumps(ORDER))
    foreign = frame(other, b"\x02\x00")
    schemas = EventSchemas(registry)
    conn = await asyncpg.connect(db_dsn)
    try:
        with pytest.raises(SchemaMismatch, match=f"schema id {other}, which is not registered"):
            await enqueue(conn, topic=topic, key="k", value_bytes=foreign, schemas=schemas)
        with anyio.fail_after(60):
            async with Relay(relay_settings(db_dsn, services, schema_registry.url)) as relay:
                await conn.execute(
                    "INSERT INTO outbox (topic, key, payload_bytes) VALUES ($1, 'x', $2)",
                    topic,
                    foreign,
                )
                for value in encoded:
                    async with conn.transaction():
                        await enqueue(
                            conn, topic=topic, key="k", value_bytes=value, schemas=schemas
                        )
                records, _ = await consume(services.bootstrap, topic, expect=5)
                await relay.events.wait_for("dead_lettered", 1)
            dead = await conn.fetch("SELECT key, error, attempts FROM outbox_dead_letter")
    finally:
        await conn.close()
    deserialize = ProtobufDeserializer(order, {"use.deprecated.format": False})
    values = [r.value for r in sorted(records, key=lambda r: r.offset)]
    assert values == encoded
    assert [deserialize(v, context).total_cents for v in values] == [0, 100, 200, 300, 400]
    assert [(d["key"], d["attempts"]) for d in dead] == [("x", 1)]
    assert f"schema id {other}, which is not registered under subject" in dead[0]["error"]


ORDER_PROTO = """
syntax = "proto3";
package acme;

import "google/protobuf/timestamp.proto";

message OrderPlaced {
  int32 order = 1;
  double total = 2;
  string note = 3;
  google.protobuf.Timestamp at = 4;
}

message OrderCancelled {
  int32 order = 1;
  string reason = 2;
}
"""


async def test_the_relay_encodes_json_rows_to_a_protobuf_subject(
    db_dsn: str,
    services: Services,
    topic: str,
    schema_registry: SchemaRegistryServer,
    registry: RegistryClient,
) -> None:
    """A PROTOBUF schema registered for the topic's subject (importing a well-known type):
    JSON rows written by plain SQL go out as its first message with Confluent's message
    indexes; RegistryDeserializer and confluent-kafka's ProtobufDeserializer read the same
    values, each key's in commit order. A row with a field the message does not have is
    dead-lettered at its first attempt with the reason; its key's next row and the other
    keys' rows flow. The producer's ``schemas=`` refuses that event before its commit."""
    schema_id = await registry.register(f"{topic}-value", ORDER_PROTO, schema_type="PROTOBUF")
    schemas = EventSchemas(registry)
    conn = await asyncpg.connect(db_dsn)
    try:
        with pytest.raises(SchemaMismatch, match='no field named "coupon"'):
            async with conn.transaction():
                await enqueue(conn, topic=topic, payload={"coupon": "x"}, schemas=schemas)
        assert await conn.fetchval("SELECT count(*) FROM outbox") == 0
        with anyio.fail_after(60):
            async with Relay(
                relay_settings(db_dsn, services, schema_registry.url, max_attempts=5)
            ) as relay:
                await conn.execute(
                    "INSERT INTO outbox (topic, key, payload) VALUES "
                    '($1, \'bad\', \'{"order": 0, "coupon": "x"}\'), '
                    "($1, 'bad', '{\"order\": 100, \"total\": 1.5}')",
                    topic,
                )
                await conn.execute(
                    "INSERT INTO outbox (topic, key, payload) SELECT $1, 'k' || (n % 3), "
                    "jsonb_build_object('order', n, 'total', n * 0.5, 'note', 'n' || n, "
                    "'at', '2026-11-28T12:00:0' || n || 'Z') FROM generate_series(1, 9) n",
                    topic,
                )
                await relay.events.wait_for("dead_lettered", 1)
                records, _ = await consume(services.bootstrap, topic, expect=10)
            dead = await conn.fetch("SELECT key, error, attempts FROM outbox_dead_letter")
    finally:
        await conn.close()
    assert [(d["key"], d["attempts"]) for d in dead] == [("bad", 1)]
    assert "schema: does not match Protobuf schema" in dead[0]["error"]
    assert 'no field named "coupon"' in dead[0]["error"]
    ours = RegistryDeserializer(registry)
    order_placed = message_class(ORDER_PROTO, "acme.OrderPlaced")
    theirs = ProtobufDeserializer(order_placed, {"use.deprecated.format": False})
    context = SerializationContext(topic, MessageField.VALUE)
    per_key: dict[bytes | None, list[dict[str, Any]]] = collections.defaultdict(list)
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        assert record.value is not None
        assert record.value[:6] == frame(schema_id, b"\x00")  # message indexes [0]
        value = await ours(record.value)
        message = theirs(record.value, context)
        assert (message.order, message.total, message.note) == (
            value["order"],
            value["total"],
            value["note"],
        )
        per_key[record.key].append(value)
    # Zeros printed, an unset message field (with presence) left out: the proto3 JSON mapping.
    assert per_key[b"bad"] == [{"order": 100, "total": 1.5, "note": ""}]
    for key in (b"k0", b"k1", b"k2"):
        orders = [v["order"] for v in per_key[key]]
        assert orders == sorted(orders), f"key {key!r} out of order"
    decoded = sorted(
        (v for k, vs in per_key.items() if k != b"bad" for v in vs), key=lambda v: v["order"]
    )
    assert decoded == [
        {"order": n, "total": n * 0.5, "note": f"n{n}", "at": f"2026-11-28T12:00:0{n}Z"}
        for n in range(1, 10)
    ]


async def test_the_topic_record_strategy_picks_the_protobuf_message_by_event_type(
    db_dsn: str,
    services: Services,
    topic: str,
    schema_registry: SchemaRegistryServer,
    registry: RegistryClient,
) -> None:
    """``topic-record``: a row's subject is ``<topic>-<event_type>`` and the event_type names
    the message of the .proto, here its second (message indexes [1])."""
    subject = f"{topic}-acme.OrderCancelled"
    schema_id = await registry.register(subject, ORDER_PROTO, schema_type="PROTOBUF")
    conn = await asyncpg.connect(db_dsn)
    try:
        with anyio.fail_after(60):
            settings = relay_settings(
                db_dsn,
                services,
                schema_registry.url,
                schema_registry_subject_strategy="topic-record",
            )
            async with Relay(settings):
                await conn.execute(
                    "INSERT INTO outbox (topic, key, payload, event_type) VALUES ($1, 'k', "
                    '\'{"order": 7, "reason": "late"}\', \'acme.OrderCancelled\')',
                    topic,
                )
                records, _ = await consume(services.bootstrap, topic, expect=1)
    finally:
        await conn.close()
    value = records[0].value
    assert value is not None
    assert value[:7] == frame(schema_id, b"\x02\x02")
    assert await RegistryDeserializer(registry)(value) == {"order": 7, "reason": "late"}
    order_cancelled = message_class(ORDER_PROTO, "acme.OrderCancelled")
    theirs = ProtobufDeserializer(order_cancelled, {"use.deprecated.format": False})
    decoded = theirs(value, SerializationContext(topic, MessageField.VALUE))
    assert decoded == order_cancelled(order=7, reason="late")


@pytest.fixture(scope="module")
def tls_registry(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[SchemaRegistryServer, Path]]:
    """A registry serving HTTPS only, with a certificate for 127.0.0.1 signed by a CA of
    its own; yields it and the CA's certificate file."""
    base = tmp_path_factory.mktemp("tls-registry")
    ca = CertificateAuthority(base / "ca")
    cert = ca.issue("registry", hosts=["127.0.0.1"])
    server = SchemaRegistryServer(base / "registry", tls=cert, ca_file=ca.cert_file)
    server.start()
    try:
        yield server, ca.cert_file
    finally:
        server.stop()


async def test_an_https_registry_is_verified_against_the_ca_setting(
    db_dsn: str, services: Services, topic: str, tls_registry: tuple[SchemaRegistryServer, Path]
) -> None:
    """``schema_registry_cafile``: the relay verifies the registry's certificate with it and
    sends Avro; without it (the system's trust store, which does not hold the test CA) the
    start is a configuration error naming the setting."""
    server, ca_file = tls_registry
    assert server.url.startswith("https://")
    client = RegistryClient(server.url, cafile=ca_file)
    try:
        schema_id = await client.register(f"{topic}-value", json.dumps(ORDER))
    finally:
        await client.aclose()
    conn = await asyncpg.connect(db_dsn)
    try:
        with anyio.fail_after(60):
            settings = relay_settings(db_dsn, services, server.url, schema_registry_cafile=ca_file)
            async with Relay(settings):
                await conn.execute(
                    "INSERT INTO outbox (topic, key, payload) "
                    "VALUES ($1, 'k', '{\"order\": 1, \"total\": 2.0}')",
                    topic,
                )
                records, _ = await consume(services.bootstrap, topic, expect=1)
    finally:
        await conn.close()
    assert records[0].value is not None
    assert unframe(records[0].value)[0] == schema_id
    with anyio.fail_after(60), pytest.raises(ConfigurationError) as raised:
        await Relay(relay_settings(db_dsn, services, server.url)).run()
    assert "TLS certificate not trusted" in str(raised.value)
    assert "SCHEMA_REGISTRY_CAFILE" in str(raised.value)


def eos_registry_settings(db_dsn: str, services: Services, url: str) -> OutboxSettings:
    tag = uuid.uuid4().hex[:8]
    return relay_settings(
        db_dsn,
        services,
        url,
        delivery="exactly-once",
        eos_slots=4,
        max_attempts=5,
        eos_marker_topic=f"eos-markers-{tag}",
        eos_transactional_id_prefix=f"registry-{tag}.",
    )


async def test_exactly_once_delivery_encodes_governed_topics_and_dead_letters_a_mismatch(
    db_dsn: str,
    services: Services,
    topic: str,
    schema_registry: SchemaRegistryServer,
    registry: RegistryClient,
    confluent: SchemaRegistryClient,
) -> None:
    """The exactly-once relay encodes as the at-least-once one: Avro records behind the
    subject's id, read back by confluent-kafka's deserializer through a read_committed
    consumer; a row that does not match is dead-lettered at once, its key's later row held
    behind it and then sent, each event once."""
    schema_id = await registry.register(f"{topic}-value", json.dumps(ORDER))
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute("UPDATE outbox_config SET delivery = 'exactly-once'")
        with anyio.fail_after(90):
            async with ExactlyOnceRelay(
                eos_registry_settings(db_dsn, services, schema_registry.url)
            ) as relay:
                await conn.execute(BAD_THEN_GOOD, topic)
                await relay.events.wait_for("dead_lettered", 1)
                await consume(
                    services.bootstrap,
                    topic,
                    expect=2,
                    client={"isolation_level": "read_committed"},
                )
            dead = await conn.fetch("SELECT key, error, attempts FROM outbox_dead_letter")
    finally:
        await conn.close()
    # Read once the relay stopped: nothing more can come.
    records, total = await consume(
        services.bootstrap, topic, expect=2, client={"isolation_level": "read_committed"}
    )
    assert total >= 2  # end offsets count the transactions' commit markers too
    assert len(records) == 2
    assert [(d["key"], d["attempts"]) for d in dead] == [("bad", 1)]
    assert "schema" in dead[0]["error"]
    assert "total" in dead[0]["error"]
    deserialize = AvroDeserializer(confluent)
    sent: dict[bytes | None, int] = {}
    for r in records:
        assert r.value is not None
        assert unframe(r.value)[0] == schema_id
        sent[r.key] = deserialize(r.value, SerializationContext(topic, MessageField.VALUE))["order"]
    assert sent == {b"bad": 2, b"good": 3}


async def test_exactly_once_rows_wait_uncounted_while_the_registry_is_down(
    db_dsn: str,
    services: Services,
    topic: str,
    schema_registry: SchemaRegistryServer,
    registry: RegistryClient,
) -> None:
    """The registry stops before the exactly-once relay loaded a row's subject: the row stays
    pending with no attempt counted and ``/readyz`` names the registry; once it answers, the
    row goes out once."""
    await registry.register(f"{topic}-value", json.dumps(ORDER))
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute("UPDATE outbox_config SET delivery = 'exactly-once'")
        with anyio.fail_after(120):
            relay = ExactlyOnceRelay(eos_registry_settings(db_dsn, services, schema_registry.url))
            metrics = RelayMetrics(relay)
            async with relay:
                schema_registry.stop()
                try:
                    await conn.execute(
                        "INSERT INTO outbox (topic, key, payload) "
                        "VALUES ($1, 'k', '{\"order\": 1, \"total\": 1.0}')",
                        topic,
                    )

                    async def registry_named() -> bool:
                        return metrics.readiness().reason.startswith("schema_registry:")

                    await eventually(registry_named, within=60, what="/readyz names it")
                    readiness = metrics.readiness()
                    row = await conn.fetchrow("SELECT attempts, published_at FROM outbox")
                finally:
                    await asyncio.to_thread(schema_registry.start)
                await consume(
                    services.bootstrap,
                    topic,
                    expect=1,
                    client={"isolation_level": "read_committed"},
                )
    finally:
        await conn.close()
    records, _ = await consume(
        services.bootstrap, topic, expect=1, client={"isolation_level": "read_committed"}
    )
    assert len(records) == 1
    assert readiness.reason == "schema_registry: unavailable (does not answer)"
    assert row is not None
    assert row["attempts"] == 0
    assert row["published_at"] is None
