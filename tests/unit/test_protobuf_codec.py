"""The Protobuf codec (issue #33, part 2): a registered .proto compiled at run time, JSON
events encoded strictly into Confluent's wire format with message indexes, the message picked
by the record name, and bytes that confluent-kafka's own Protobuf serde reads and writes.
Without a registry: the relay's and producers' paths use a fake client."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka.schema_registry._sync.mock_schema_registry_client import (
    MockSchemaRegistryClient,
)
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from notify_outbox.kafka.registry import codecs
from notify_outbox.kafka.registry.codecs import (
    ProtobufCodec,
    codec_for,
    message_indexes,
    read_message_indexes,
)
from notify_outbox.schemaregistry import (
    EventSchemas,
    EventToCheck,
    RegisteredSchema,
    RegistryDeserializer,
    RowEncoder,
    SchemaMismatch,
    StaticSchema,
    UnsupportedSchema,
    frame,
    unframe,
)
from tests.unit.test_schemaregistry import FakeRegistry, row, value_of

pytestmark = pytest.mark.anyio

SHOP = """
syntax = "proto3";
package shop;

import "google/protobuf/timestamp.proto";

message OrderPlaced {
  string order_id = 1;
  int64 total_cents = 2;
  google.protobuf.Timestamp at = 3;
  repeated Line lines = 4;
  message Line {
    string sku = 1;
    int32 qty = 2;
  }
}

message OrderCancelled {
  string order_id = 1;
  string reason = 2;
}
"""

LEGACY = """
syntax = "proto2";
package legacy;

message Payment {
  required string id = 1;
  optional int32 cents = 2;
}
"""

CONTEXT = SerializationContext("orders", MessageField.VALUE)


def shop(schema_id: int = 7, subject: str | None = "orders-value") -> ProtobufCodec:
    codec = codec_for(
        RegisteredSchema(id=schema_id, schema=SHOP, schema_type="PROTOBUF", subject=subject)
    )
    assert isinstance(codec, ProtobufCodec)
    return codec


def message_class(schema: str, name: str) -> Any:
    """A message class of ``schema`` built apart from the codec's (a pool of its own), from
    the same compiled descriptors: what a consumer with generated code would hold."""
    compiled = codecs._compiled(schema)
    assert isinstance(compiled, bytes)
    pool = descriptor_pool.DescriptorPool()
    for file in descriptor_pb2.FileDescriptorSet.FromString(compiled).file:
        pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))


def test_message_indexes_are_confluents_zigzag_varints() -> None:
    assert message_indexes([0]) == b"\x00"  # the first message: one byte
    assert message_indexes([1]) == b"\x02\x02"  # count 1, index 1 (zig-zag: 2)
    assert message_indexes([0, 0]) == b"\x04\x00\x00"
    assert message_indexes([70]) == b"\x02\x8c\x01"  # 140: two varint bytes
    for path in ([0], [1], [0, 0], [3, 1, 2], [70]):
        encoded = message_indexes(path) + b"rest"
        assert read_message_indexes(encoded) == (path, len(encoded) - 4)
    with pytest.raises(ValueError, match="truncated"):
        read_message_indexes(b"\x04\x00")


def test_a_json_event_round_trips_through_the_first_message() -> None:
    codec = shop()
    event = {
        "order_id": "o-1",
        "total_cents": 1250,
        "at": "2026-11-28T12:00:00Z",  # the well-known Timestamp, by its JSON mapping
        "lines": [{"sku": "a", "qty": 2}],
    }
    encoded = codec.encode(event)
    schema_id, body = unframe(encoded)
    assert schema_id == 7
    assert body[0] == 0  # message indexes [0]
    # Decoded by the proto3 JSON mapping: 64-bit integers as strings, zeros printed.
    assert codec.decode(body) == {**event, "total_cents": "1250"}
    assert codec.decode(unframe(codec.encode({"order_id": "o-2"}))[1]) == {
        "order_id": "o-2",
        "total_cents": "0",
        "lines": [],
    }


def test_the_record_name_picks_the_message_by_full_or_simple_name() -> None:
    codec = shop()
    cancelled = codec.encode({"order_id": "o-1", "reason": "r"}, record="shop.OrderCancelled")
    assert unframe(cancelled)[1][:2] == b"\x02\x02"  # indexes [1]
    assert codec.encode({"order_id": "o-1", "reason": "r"}, record="OrderCancelled") == cancelled
    line = codec.encode({"sku": "x"}, record="shop.OrderPlaced.Line")
    assert unframe(line)[1][:3] == b"\x04\x00\x00"  # indexes [0, 0]
    assert codec.decode(unframe(line)[1]) == {"sku": "x", "qty": 0}
    with pytest.raises(SchemaMismatch, match=r"declares no message 'acme.Refund'.*OrderCancelled"):
        codec.check({}, record="acme.Refund")
    with pytest.raises(SchemaMismatch, match=r"declares no message 'google\.protobuf\.Timestamp'"):
        codec.check({}, record="google.protobuf.Timestamp")  # an import's, not the schema's


def test_mismatches_name_the_field_and_the_schema() -> None:
    codec = shop()
    for value, problem in [
        ({"order_id": 5}, "order_id"),
        ({"order_id": "o", "coupon": "x"}, 'no field named "coupon"'),
        ({"total_cents": "many"}, "total_cents"),
        ({"lines": [{"qty": 1.5}]}, "qty"),
        ({"at": "yesterday"}, "at"),
        (["o-1"], "needs a JSON object, not list"),
    ]:
        with pytest.raises(SchemaMismatch, match=problem) as raised:
            codec.check(value)
        assert "Protobuf schema id 7 (subject 'orders-value')" in str(raised.value)
        assert "\n" not in str(raised.value)
    legacy = codec_for(RegisteredSchema(id=3, schema=LEGACY, schema_type="PROTOBUF"))
    with pytest.raises(SchemaMismatch, match=r"missing required field.* id"):
        legacy.encode({"cents": 1})
    assert legacy.decode(unframe(legacy.encode({"id": "p"}))[1]) == {"id": "p"}


def test_schemas_that_cannot_be_compiled_are_unsupported_with_protocs_reason() -> None:
    def compile_(text: str) -> None:
        codec_for(RegisteredSchema(id=9, schema=text, schema_type="PROTOBUF"))

    with pytest.raises(UnsupportedSchema, match=r'line 1:32: "strin" is not defined'):
        compile_("syntax = 'proto3'; message A { strin x = 1; }")
    with pytest.raises(UnsupportedSchema, match="schema references, are not supported"):
        compile_("syntax = 'proto3'; import 'acme/money.proto'; message A { int32 x = 1; }")
    with pytest.raises(UnsupportedSchema, match="declares no Protobuf message"):
        compile_("syntax = 'proto3'; enum E { E_UNSET = 0; }")
    with pytest.raises(UnsupportedSchema, match="of type XML"):
        codec_for(RegisteredSchema(id=9, schema="<a/>", schema_type="XML"))


def test_each_schema_text_is_compiled_once() -> None:
    text = SHOP + "\n// compiled once\n"
    before = codecs._compiled.cache_info()
    first = codec_for(RegisteredSchema(id=1, schema=text, schema_type="PROTOBUF"))
    second = codec_for(RegisteredSchema(id=2, schema=text, schema_type="PROTOBUF"))
    after = codecs._compiled.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    # Each codec has its own pool and prefix: the same names under two ids do not collide.
    assert unframe(first.encode({}))[0] == 1
    assert unframe(second.encode({}))[0] == 2


def test_confluents_deserializer_reads_what_the_codec_writes() -> None:
    """Our bytes, read by confluent-kafka's ProtobufDeserializer with a message class built
    apart from the codec's: the first message and a later one (their message indexes)."""
    codec = shop()
    placed = codec.encode({"order_id": "o-1", "total_cents": 99, "lines": [{"sku": "s"}]})
    order_placed = message_class(SHOP, "shop.OrderPlaced")
    decoded = ProtobufDeserializer(order_placed, {"use.deprecated.format": False})(placed, CONTEXT)
    assert decoded.order_id == "o-1"
    assert decoded.total_cents == 99
    assert [line.sku for line in decoded.lines] == ["s"]
    cancelled = codec.encode({"order_id": "o-2", "reason": "late"}, record="OrderCancelled")
    order_cancelled = message_class(SHOP, "shop.OrderCancelled")
    decode = ProtobufDeserializer(order_cancelled, {"use.deprecated.format": False})
    assert decode(cancelled, CONTEXT) == order_cancelled(order_id="o-2", reason="late")


def test_the_codec_reads_what_confluents_serializer_writes() -> None:
    """confluent-kafka's ProtobufSerializer (registering with its mock registry) writes a
    message that is not the file's first and a nested one; the codec decodes both."""
    registry = MockSchemaRegistryClient({"url": "mock://registry"})
    codec = shop()
    cases: list[tuple[str, dict[str, Any]]] = [
        ("shop.OrderCancelled", {"order_id": "o-3", "reason": "r"}),
        ("shop.OrderPlaced.Line", {"sku": "q", "qty": 3}),
        ("shop.OrderPlaced", {"order_id": "o-4", "total_cents": 5}),
    ]
    for name, fields in cases:
        cls = message_class(SHOP, name)
        serialize = ProtobufSerializer(cls, registry, {"use.deprecated.format": False})
        written = serialize(cls(**fields), CONTEXT)
        assert written is not None
        decoded = codec.decode(unframe(written)[1])
        assert {k: v for k, v in decoded.items() if k in fields} == {
            k: str(v) if k == "total_cents" else v for k, v in fields.items()
        }


def protobuf_subject(subject: str, schema_id: int = 4) -> RegisteredSchema:
    return RegisteredSchema(id=schema_id, schema=SHOP, schema_type="PROTOBUF", subject=subject)


async def test_the_relay_encodes_protobuf_rows_by_the_topic_strategy() -> None:
    registry = FakeRegistry()
    registry.subjects["orders-value"] = protobuf_subject("orders-value")
    encoder = RowEncoder(registry)
    # The topic strategy: the event_type is free text, the message is the first.
    good = row("orders", {"order_id": "o-1"}, event_type="OrderCancelled")
    await encoder.prepare([good])
    assert value_of(encoder.encode(good, b"k", b"ignored")) == frame(4, b"\x00\n\x03o-1")
    with pytest.raises(SchemaMismatch, match='no field named "reason"'):
        encoder.encode(row("orders", {"reason": "x"}), b"k", b"ignored")
    decode = RegistryDeserializer(registry)
    assert (await decode(value_of(encoder.encode(good, b"k", b"x"))))["order_id"] == "o-1"


async def test_record_strategies_pick_the_message_by_the_event_type() -> None:
    registry = FakeRegistry()
    registry.subjects["orders-shop.OrderCancelled"] = protobuf_subject("orders-shop.OrderCancelled")
    encoder = RowEncoder(registry, strategy="topic-record")
    cancelled = row("orders", {"order_id": "o-1", "reason": "r"}, event_type="shop.OrderCancelled")
    await encoder.prepare([cancelled])
    value = value_of(encoder.encode(cancelled, None, b"x"))
    assert unframe(value)[1][:2] == b"\x02\x02"  # OrderCancelled: indexes [1]
    registry.subjects["shop.OrderCancelled"] = protobuf_subject("shop.OrderCancelled")
    schemas = EventSchemas(registry, strategy="record")
    await schemas.check_events([EventToCheck("orders", "shop.OrderCancelled", {"reason": "r"})])
    with pytest.raises(SchemaMismatch, match=r"topic 'orders' .*message shop.OrderCancelled"):
        await schemas.check_events([EventToCheck("orders", "shop.OrderCancelled", {"x": 1})])


def test_a_static_protobuf_schema_checks_against_the_first_message() -> None:
    static = StaticSchema(SHOP, "PROTOBUF")
    static.check({"order_id": "o-1", "total_cents": 5})
    with pytest.raises(SchemaMismatch, match="order_id"):
        static.check_events_now([EventToCheck("orders", None, {"order_id": 1})])
