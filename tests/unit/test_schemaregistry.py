"""The Schema Registry's codecs, subject names and caches (issue #33, part 2), without a
registry: a fake client stands in for its REST calls. The real registry, Kafka and the
relay are in tests/integration/test_schema_registry.py."""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest

from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.outbox import OutboxRow
from notify_outbox.kafka.registry import serde
from notify_outbox.kafka.registry.codecs import codec_for
from notify_outbox.schemaregistry import (
    EventSchemas,
    EventToCheck,
    RegisteredSchema,
    RegistryClient,
    RegistryDeserializer,
    RegistryUnavailable,
    RowEncoder,
    SchemaMismatch,
    StaticSchema,
    SubjectNotFound,
    frame,
    subject_name,
    unframe,
)

pytestmark = pytest.mark.anyio

ORDER = json.dumps(
    {
        "type": "record",
        "name": "OrderPlaced",
        "namespace": "acme",
        "fields": [
            {"name": "order", "type": "long"},
            {"name": "note", "type": ["null", "string"], "default": None},
        ],
    }
)
ORDER_V2 = json.dumps(
    {
        **json.loads(ORDER),
        "fields": [*json.loads(ORDER)["fields"], {"name": "extra", "type": "long", "default": 0}],
    }
)


class FakeRegistry(RegistryClient):
    """The REST calls answered from a dict; ``down`` makes every call fail as unreachable."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:1")
        self.subjects: dict[str, RegisteredSchema] = {}
        self.calls: list[str] = []
        self.down = False

    async def latest(self, subject: str) -> RegisteredSchema:
        self.calls.append(subject)
        if self.down:
            raise RegistryUnavailable("registry down")
        if subject not in self.subjects:
            raise SubjectNotFound(f"no schema registered under subject {subject!r}")
        return self.subjects[subject]

    async def subjects_of(self, schema_id: int) -> set[str]:
        self.calls.append(f"subjects:{schema_id}")
        if self.down:
            raise RegistryUnavailable("registry down")
        return {name for name, s in self.subjects.items() if s.id == schema_id}

    async def by_id(self, schema_id: int) -> RegisteredSchema:
        self.calls.append(f"id:{schema_id}")
        return next(s for s in self.subjects.values() if s.id == schema_id)


def row(topic: str, payload: Any = None, *, key: str | None = "k", **kw: Any) -> OutboxRow:
    return OutboxRow(
        id=1,
        event_id=uuid.uuid4(),
        topic=topic,
        key=key,
        payload=None if payload is None else json.dumps(payload),
        payload_bytes=kw.pop("payload_bytes", None),
        headers=None,
        **kw,
    )


def test_the_wire_format_is_magic_byte_zero_then_the_id_big_endian() -> None:
    assert frame(258, b"body") == b"\x00\x00\x00\x01\x02body"
    assert unframe(b"\x00\x00\x00\x01\x02body") == (258, b"body")
    with pytest.raises(ValueError, match="wire format"):
        unframe(b'{"a": 1}')


def test_subject_names_follow_confluents_strategies() -> None:
    assert subject_name("topic", "orders", "acme.OrderPlaced") == "orders-value"
    assert subject_name("topic", "orders", None, key=True) == "orders-key"
    assert subject_name("record", "orders", "acme.OrderPlaced") == "acme.OrderPlaced"
    assert subject_name("topic-record", "orders", "acme.OrderPlaced") == "orders-acme.OrderPlaced"
    with pytest.raises(SchemaMismatch, match="needs an event_type"):
        subject_name("record", "orders", None)


def test_avro_is_strict_about_missing_extra_and_mistyped_fields() -> None:
    codec = codec_for(RegisteredSchema(id=7, schema=ORDER, subject="orders-value"))
    encoded = codec.encode({"order": 5})  # note: its default
    assert unframe(encoded)[0] == 7
    assert codec.decode(unframe(encoded)[1]) == {"order": 5, "note": None}
    for value, problem in [
        ({}, "order"),
        ({"order": 1, "other": 2}, "other"),
        ({"order": "five"}, "order"),
    ]:
        with pytest.raises(SchemaMismatch, match=problem) as raised:
            codec.check(value)
        assert "id 7 (subject 'orders-value')" in str(raised.value)


def test_json_schema_says_where_an_event_breaks_it() -> None:
    schema = {
        "type": "object",
        "properties": {"lines": {"type": "array", "items": {"type": "integer"}}},
        "required": ["lines"],
    }
    codec = codec_for(RegisteredSchema(id=3, schema=json.dumps(schema), schema_type="JSON"))
    assert codec.encode({"lines": [1]}, b'{"lines": [1]}') == frame(3, b'{"lines": [1]}')
    with pytest.raises(SchemaMismatch, match=r"at lines/1: 'x' is not of type 'integer'"):
        codec.check({"lines": [1, "x"]})


async def test_the_encoder_caches_subjects_and_encodes_only_governed_topics() -> None:
    registry = FakeRegistry()
    registry.subjects["orders-value"] = RegisteredSchema(id=9, schema=ORDER, subject="orders-value")
    encoder = RowEncoder(registry, topics="orders,pay*")
    rows = [row("orders", {"order": n}) for n in range(5)] + [row("audit", {"x": 1})]
    await encoder.prepare(rows)
    await encoder.prepare(rows)
    assert registry.calls == ["orders-value"]  # once, and never for the ungoverned topic
    assert not encoder.governs("audit")
    assert encoder.governs("payments")
    key, value = encoder.encode(rows[0], b"k", b"ignored")
    assert key == b"k"
    assert value is not None
    assert unframe(value)[0] == 9
    with pytest.raises(SchemaMismatch, match="value_bytes must be in the registry's wire"):
        encoder.encode(row("orders", payload_bytes=b"raw"), b"k", b"raw")
    framed = frame(9, b"\x02\x00")
    pre_encoded = row("orders", payload_bytes=framed)
    await encoder.prepare([pre_encoded])
    assert encoder.encode(pre_encoded, b"k", framed)[1] == framed
    # An id of another subject (or none the registry knows) is refused.
    foreign = row("orders", payload_bytes=frame(8, b"\x02\x00"))
    await encoder.prepare([foreign])
    with pytest.raises(SchemaMismatch, match="schema id 8, which is not registered under"):
        encoder.encode(foreign, b"k", foreign.payload_bytes)


async def test_a_known_schema_is_kept_through_an_outage_and_a_new_one_is_not_invented() -> None:
    registry = FakeRegistry()
    registry.subjects["a-value"] = RegisteredSchema(id=1, schema=ORDER)
    encoder = RowEncoder(registry, refresh=0.001)
    await encoder.prepare([row("a", {"order": 1})])
    registry.down = True
    await encoder.prepare([row("a", {"order": 1})])  # expired, refetch fails: kept
    assert encoder.encode(row("a", {"order": 1}), None, b"x")[1] is not None
    with pytest.raises(RegistryUnavailable):
        await encoder.prepare([row("b", {"order": 1})])


async def test_a_missing_subject_fails_the_row_and_is_looked_up_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry = FakeRegistry()
    encoder = RowEncoder(registry)
    r = row("late", {"order": 1})
    await encoder.prepare([r])
    with pytest.raises(SubjectNotFound, match="'late-value'"):
        encoder.encode(r, None, b"x")
    registry.subjects["late-value"] = RegisteredSchema(id=4, schema=ORDER)
    await encoder.prepare([r])
    assert registry.calls == ["late-value"]  # a missing subject is cached for a moment
    monkeypatch.setattr(serde, "_MISSING_RETRY_S", 0.0)
    await encoder.prepare([r])
    assert unframe(encoder.encode(r, None, b"x")[1] or b"")[0] == 4


async def test_a_mismatch_re_reads_a_stale_subject_before_it_is_final(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The producer registered v2 and wrote an event of it while the relay still had v1."""
    registry = FakeRegistry()
    registry.subjects["o-value"] = RegisteredSchema(id=1, schema=ORDER)
    encoder = RowEncoder(registry)
    await encoder.prepare([row("o", {"order": 1})])
    registry.subjects["o-value"] = RegisteredSchema(id=2, schema=ORDER_V2)
    newer = row("o", {"order": 1, "extra": 5})
    with pytest.raises(SchemaMismatch):
        encoder.encode(newer, None, b"x")
    monkeypatch.setattr(serde, "_RECHECK_AFTER_S", 0.0)
    assert unframe(value_of(await encoder.encode_rechecked(newer, None, b"x")))[0] == 2
    with pytest.raises(SchemaMismatch, match="other"):
        await encoder.encode_rechecked(row("o", {"order": 1, "other": 1}), None, b"x")


def value_of(encoded: tuple[bytes | None, bytes | None]) -> bytes:
    assert encoded[1] is not None
    return encoded[1]


async def test_keys_are_encoded_with_the_key_subject_when_asked() -> None:
    registry = FakeRegistry()
    registry.subjects["o-value"] = RegisteredSchema(id=1, schema=ORDER)
    registry.subjects["o-key"] = RegisteredSchema(id=5, schema='"string"')
    encoder = RowEncoder(registry, keys=True)
    r = row("o", {"order": 1}, key="customer-1")
    await encoder.prepare([r])
    key, _ = encoder.encode(r, b"customer-1", b"x")
    assert key == frame(5, b"\x14customer-1")  # Avro string: zig-zag length 10, then bytes


async def test_producer_checks_refuse_mismatches_and_frameless_bytes() -> None:
    registry = FakeRegistry()
    registry.subjects["o-value"] = RegisteredSchema(id=1, schema=ORDER)
    schemas = EventSchemas(registry, topics="o")
    await schemas.check_events(
        [
            EventToCheck("o", None, {"order": 1}),
            EventToCheck("other", None, {"anything": True}),  # not governed
            EventToCheck("o", None, has_payload=False),  # a tombstone
            EventToCheck("o", None, value_bytes=frame(1, b"\x02\x00")),
        ]
    )
    with pytest.raises(SchemaMismatch, match="schema id 2, which is not registered under"):
        await schemas.check_events([EventToCheck("o", None, value_bytes=frame(2, b""))])
    with pytest.raises(SchemaMismatch, match="topic 'o' does not match Avro schema"):
        await schemas.check_events([EventToCheck("o", None, {"order": "x"})])
    with pytest.raises(SchemaMismatch, match="wire format"):
        await schemas.check_events([EventToCheck("o", None, value_bytes=b"raw")])
    static = StaticSchema(ORDER)
    static.check_events_now([EventToCheck("o", None, {"order": 2})])
    with pytest.raises(SchemaMismatch):
        static.check({"note": "no order"})


async def test_the_deserializer_fetches_each_writer_schema_once() -> None:
    registry = FakeRegistry()
    registry.subjects["o-value"] = RegisteredSchema(id=6, schema=ORDER)
    decode = RegistryDeserializer(registry)
    record = codec_for(registry.subjects["o-value"]).encode({"order": 3, "note": "hi"})
    assert await decode(record) == {"order": 3, "note": "hi"}
    assert await decode(record) == {"order": 3, "note": "hi"}
    assert await decode(None) is None
    assert registry.calls == ["id:6"]


def test_registry_urls_with_credentials_or_no_host_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="own settings") as raised:
        RegistryClient("https://user:s3cret@registry:8081")
    assert "s3cret" not in str(raised.value)
    with pytest.raises(ConfigurationError, match="http"):
        RegistryClient("registry:8081")


async def test_a_registry_that_refuses_connections_is_unavailable_not_misconfigured() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: refused
        client = RegistryClient(f"http://127.0.0.1:{sock.getsockname()[1]}", password="pw")
        with pytest.raises(RegistryUnavailable, match="unreachable") as raised:
            await client.probe()
        await client.aclose()
    assert "pw" not in str(raised.value)


def test_a_registry_ca_file_that_does_not_load_is_a_configuration_error(tmp_path: Path) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    for cafile in (bad, tmp_path / "missing.pem"):
        with pytest.raises(ConfigurationError, match=r"CA file .* cannot be read"):
            RegistryClient("https://registry:8081", cafile=cafile)
