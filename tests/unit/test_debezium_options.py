"""Debezium-compatible mode without a database: the router's options, a connector
configuration, the topic pattern and the record mapping of a captured row."""

from __future__ import annotations

import json
import logging
import uuid

import pytest

from notify_outbox import ConfigurationError, OutboxNames
from notify_outbox.core.outbox import OutboxRow
from notify_outbox.debezium.capture import (
    DebeziumCapture,
    HeaderField,
    parse_connector_config,
    render_capture,
)
from notify_outbox.kafka.publisher import to_message


def test_defaults_are_the_routers() -> None:
    c = DebeziumCapture.from_options({})
    assert (c.field_event_id, c.field_event_key, c.field_payload, c.route_by_field) == (
        "id",
        "aggregateid",
        "payload",
        "aggregatetype",
    )
    assert c.topic_for("order") == "outbox.event.order"
    assert c.additional_headers == ()
    assert c == DebeziumCapture()


@pytest.mark.parametrize(
    ("replacement", "topic"),
    [
        ("${routedByValue}.events", "Order.events"),
        ("$1-events", "Order-events"),
        ("events.$0", "events.Order"),
        ("fixed", "fixed"),
        ("a\\$b", None),  # an escaped dollar is literal text, and not a topic character
    ],
)
def test_topic_replacement_follows_java_rules(replacement: str, topic: str | None) -> None:
    options = {"route.topic.replacement": replacement}
    if topic is None:
        with pytest.raises(ConfigurationError, match="fixed text"):
            DebeziumCapture.from_options(options)
    else:
        assert DebeziumCapture.from_options(options).topic_for("Order") == topic


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"route.topic.replacement": "${other}.x"}, "no group named 'other'"),
        ({"route.topic.replacement": "$x"}, "must be followed by"),
        ({"route.topic.regex": "(?<routedByValue>[a-z]+)"}, "only the default"),
        ({"table.expand.json.payload": "true"}, "not supported"),
        ({"table.field.event.timestamp": "ts"}, "not supported"),
        ({"route.topic.replacment": "x"}, "unknown outbox event router option"),
        ({"table.fields.additional.placement": "type:envelope:t"}, "'envelope' is not supported"),
        ({"table.fields.additional.placement": "p:partition"}, "'partition' is not supported"),
        ({"table.fields.additional.placement": "type:headr"}, "must be header"),
        ({"table.fields.additional.placement": "type"}, "column:placement"),
        ({"table.fields.additional.placement": "type:header:id"}, "would appear twice"),
        ({"table.fields.additional.placement": "a:header:x,b:header:x"}, "would appear twice"),
        ({"table.field.event.key": "agg id"}, "must be a column name"),
        ({"route.tombstone.on.empty.payload": "yes"}, "true or false"),
        ({"table.op.invalid.behavior": "fatal"}, "only warn or error"),
    ],
)
def test_bad_options_are_refused_by_name(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        DebeziumCapture.from_options(options)


def test_additional_header_fields_parse_like_the_router() -> None:
    c = DebeziumCapture.from_options(
        {"table.fields.additional.placement": " eventType:header:type , tenant:HEADER "}
    )
    assert c.additional_headers == (
        HeaderField("eventType", "type"),
        HeaderField("tenant", "tenant"),
    )


_ROUTER = "io.debezium.transforms.outbox.EventRouter"


def test_a_properties_connector_config() -> None:
    text = """
    # the connector
    connector.class=io.debezium.connector.postgresql.PostgresConnector
    transforms=outbox
    transforms.outbox.type=io.debezium.transforms.outbox.EventRouter
    transforms.outbox.route.topic.replacement=${routedByValue}.events
    transforms.outbox.table.fields.additional.placement=type:header:eventType
    transforms.other.type=org.apache.kafka.connect.transforms.RegexRouter
    transforms.other.regex=x
    """
    assert parse_connector_config(text) == {
        "route.topic.replacement": "${routedByValue}.events",
        "table.fields.additional.placement": "type:header:eventType",
    }


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"value.converter": "org.apache.kafka.connect.json.JsonConverter"}, "value.converter"),
        ({"key.converter": "io.confluent.connect.avro.AvroConverter"}, "key.converter"),
        ({"header.converter": "x.Y"}, "header.converter"),
    ],
)
def test_converters_other_than_raw_bytes_are_refused(config: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        parse_connector_config(json.dumps({"config": config}))


def test_the_rendered_capture_quotes_names_and_maps_the_options() -> None:
    c = DebeziumCapture.from_options(
        {
            "route.topic.replacement": "${routedByValue}.events",
            "table.fields.additional.placement": "eventType:header:type",
        },
        schema="inventory",
        table="outboxevent",
    )
    sql = render_capture(c, OutboxNames(table="relay_outbox"))
    assert "topic := routed || '.events';" in sql
    assert "jsonb_build_object('id', NEW.\"id\"::text, 'type', NEW.\"eventType\"::text)" in sql
    assert 'AFTER INSERT ON "inventory"."outboxevent"' in sql
    assert 'INSERT INTO "public"."relay_outbox"' in sql


def row(headers: str | None, key: str | None = "1", payload: bytes | None = b"{}") -> OutboxRow:
    return OutboxRow(
        id=1,
        event_id=uuid.uuid4(),
        topic="outbox.event.order",
        key=key,
        payload=None,
        payload_bytes=payload,
        headers=headers,
        event_type="OrderCreated",
        aggregate_type="order",
        aggregate_id="1",
    )


def test_debezium_header_style_sends_only_the_rows_headers_id_first() -> None:
    msg = to_message(row('{"type": "OrderCreated", "id": "abc"}'), header_style="debezium")
    assert msg.headers == [("id", b"abc"), ("type", b"OrderCreated")]
    assert (msg.key, msg.value) == (b"1", b"{}")
    # The router sends a null key with a null value as it is.
    assert to_message(row('{"id": "abc"}', None, None), header_style="debezium").value is None
    # A NULL column is a header with a null value (SimpleHeaderConverter).
    assert to_message(row('{"id": "abc", "t": null}'), header_style="debezium").headers == [
        ("id", b"abc"),
        ("t", None),
    ]


@pytest.mark.parametrize("headers", [None, "[]", '{"type": "x"}', '{"id": "a", "n": 1}'])
def test_debezium_header_style_refuses_rows_the_capture_did_not_write(headers: str | None) -> None:
    with pytest.raises(ValueError, match=r"id|string"):
        to_message(row(headers), header_style="debezium")


def test_converters_left_to_the_worker_are_pointed_out(caplog: pytest.LogCaptureFixture) -> None:
    """The worker's default converters (often JsonConverter) are not in the connector's file:
    the consumers' bytes may differ, which is said, not refused."""
    router = {"transforms": "outbox", "transforms.outbox.type": _ROUTER}
    with caplog.at_level(logging.WARNING, logger="notify_outbox.debezium"):
        parse_connector_config(json.dumps({"config": router}))
    assert "key.converter and value.converter not set" in caplog.text
    assert "docs/debezium-costs.md" in caplog.text
    caplog.clear()
    raw = "org.apache.kafka.connect.storage.StringConverter"
    with caplog.at_level(logging.WARNING, logger="notify_outbox.debezium"):
        parse_connector_config(
            json.dumps({"config": {**router, "key.converter": raw, "value.converter": raw}})
        )
    assert caplog.text == ""
