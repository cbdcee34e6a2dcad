"""Confluent's wire format and the codecs behind it: Avro (fastavro) and JSON Schema
(jsonschema). A record's value is ``0x00``, the schema's registry id (4 bytes, big-endian),
then the body: Avro's binary encoding, or the JSON text.

Protobuf is framed the same way with message indexes, but encoding a JSON event to it needs
the compiled message: producers that use Protobuf write ``value_bytes`` already encoded.
"""

from __future__ import annotations

import io
import json
import struct
from typing import Any, Protocol

from notify_outbox.core.errors import EventValidationError
from notify_outbox.kafka.registry.client import RegisteredSchema

__all__ = [
    "AvroCodec",
    "Codec",
    "JsonSchemaCodec",
    "SchemaMismatch",
    "UnsupportedSchema",
    "codec_for",
    "frame",
    "is_framed",
    "unframe",
]

_MAGIC = 0
_PREFIX = struct.Struct(">bI")


class SchemaMismatch(EventValidationError):
    """An event does not match its topic's schema: it never will, so it is refused before
    the producer's commit, or dead-lettered by the relay at once."""


class UnsupportedSchema(EventValidationError):
    """A registered schema of a kind this library does not encode (Protobuf, for JSON events)."""


def frame(schema_id: int, body: bytes) -> bytes:
    """Confluent's wire format: magic byte 0, the schema id, the body."""
    return _PREFIX.pack(_MAGIC, schema_id) + body


def is_framed(data: bytes) -> bool:
    """Whether ``data`` starts like a record in Confluent's wire format."""
    return len(data) >= _PREFIX.size and data[0] == _MAGIC


def unframe(data: bytes) -> tuple[int, bytes]:
    """The schema id and the body of a record in Confluent's wire format."""
    if not is_framed(data):
        raise ValueError("not in the Schema Registry wire format (no magic byte 0 and schema id)")
    _, schema_id = _PREFIX.unpack_from(data)
    return schema_id, data[_PREFIX.size :]


class Codec(Protocol):
    """One registered schema's encoder and decoder."""

    schema: RegisteredSchema

    def encode(self, value: Any, text: bytes | None = None) -> bytes:
        """The framed record of ``value`` (``text``: the same value as JSON text, when the
        caller has it). Raises ``SchemaMismatch``."""

    def check(self, value: Any) -> None:
        """Raise ``SchemaMismatch`` unless ``value`` matches the schema."""

    def decode(self, body: bytes) -> Any:
        """The value of a record's body (after the wire format's prefix)."""


class AvroCodec:
    """Avro's binary encoding of JSON-shaped values. Strict: a field missing without a
    default, or a field the schema does not have, is a mismatch (not a silent null or drop)."""

    def __init__(self, schema: RegisteredSchema) -> None:
        import fastavro  # the schema-registry extra

        self.schema = schema
        self._fastavro = fastavro
        try:
            self._parsed = fastavro.parse_schema(json.loads(schema.schema))
        except (ValueError, TypeError, KeyError) as e:
            raise UnsupportedSchema(f"schema {schema.id} is not a valid Avro schema: {e}") from None
        # One buffer for every record (a codec serves one event loop, and encoding does not
        # await): its first bytes are the prefix, the body is written after them each time.
        self._out = io.BytesIO(_PREFIX.pack(_MAGIC, schema.id))

    def _write(self, value: Any) -> bytes:
        out = self._out
        out.seek(_PREFIX.size)
        out.truncate()
        try:
            self._fastavro.schemaless_writer(out, self._parsed, value, strict_allow_default=True)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
            raise SchemaMismatch(f"does not match Avro schema {self._describe()}: {e}") from None
        return out.getvalue()

    def _describe(self) -> str:
        where = f" (subject {self.schema.subject!r})" if self.schema.subject else ""
        return f"id {self.schema.id}{where}"

    def encode(self, value: Any, text: bytes | None = None) -> bytes:
        return self._write(value)

    def check(self, value: Any) -> None:
        self._write(value)

    def decode(self, body: bytes) -> Any:
        return self._fastavro.schemaless_reader(io.BytesIO(body), self._parsed, None)


class JsonSchemaCodec:
    """JSON Schema: the body is the JSON text itself, checked against the schema."""

    def __init__(self, schema: RegisteredSchema) -> None:
        import jsonschema  # the schema-registry extra

        self.schema = schema
        try:
            document = json.loads(schema.schema)
            cls = jsonschema.validators.validator_for(document)
            cls.check_schema(document)
        except (ValueError, jsonschema.SchemaError) as e:
            raise UnsupportedSchema(f"schema {schema.id} is not a valid JSON Schema: {e}") from None
        self._validator = cls(document)
        self._best_match = jsonschema.exceptions.best_match
        self._prefix = _PREFIX.pack(_MAGIC, schema.id)

    def check(self, value: Any) -> None:
        error = self._best_match(self._validator.iter_errors(value))
        if error is not None:
            path = "/".join(str(p) for p in error.absolute_path) or "(the event)"
            where = f" (subject {self.schema.subject!r})" if self.schema.subject else ""
            raise SchemaMismatch(
                f"does not match JSON Schema id {self.schema.id}{where}: at {path}: {error.message}"
            )

    def encode(self, value: Any, text: bytes | None = None) -> bytes:
        self.check(value)
        if text is None:
            text = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
        return self._prefix + text

    def decode(self, body: bytes) -> Any:
        return json.loads(body)


def codec_for(schema: RegisteredSchema) -> Codec:
    """The codec of a registered schema. Raises ``UnsupportedSchema`` for Protobuf."""
    kind = schema.schema_type.upper()
    if kind == "AVRO":
        return AvroCodec(schema)
    if kind == "JSON":
        return JsonSchemaCodec(schema)
    raise UnsupportedSchema(
        f"schema {schema.id} is {kind}: the relay encodes JSON events to Avro and JSON Schema "
        "only; encode Protobuf events in the producer and write them as value_bytes"
    )
