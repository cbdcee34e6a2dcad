"""Confluent's wire format and the codecs behind it: Avro (fastavro), JSON Schema
(jsonschema) and Protobuf (protobuf, with protoc from grpcio-tools). A record's value is
``0x00``, the schema's registry id (4 bytes, big-endian), then the body: Avro's binary
encoding, the JSON text, or Protobuf's message indexes and then the serialized message.
"""

from __future__ import annotations

import functools
import io
import json
import os
import struct
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from notify_outbox.core.errors import EventValidationError
from notify_outbox.kafka.registry.client import RegisteredSchema

if TYPE_CHECKING:
    from google.protobuf.descriptor import Descriptor
    from google.protobuf.message import Message

__all__ = [
    "AvroCodec",
    "Codec",
    "JsonSchemaCodec",
    "ProtobufCodec",
    "SchemaMismatch",
    "UnsupportedSchema",
    "codec_for",
    "frame",
    "is_framed",
    "message_indexes",
    "read_message_indexes",
    "unframe",
]

_MAGIC = 0
_PREFIX = struct.Struct(">bI")


class SchemaMismatch(EventValidationError):
    """An event does not match its topic's schema: it never will, so it is refused before
    the producer's commit, or dead-lettered by the relay at once."""


class UnsupportedSchema(EventValidationError):
    """A registered schema this library cannot encode with: not valid, of an unknown kind,
    or a Protobuf schema that imports another registered schema (references)."""


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
    """One registered schema's encoder and decoder. ``record``: the record name under the
    record subject strategies (the event's ``event_type``), which picks the message of a
    Protobuf schema declaring several; Avro and JSON Schema have one root and ignore it."""

    schema: RegisteredSchema

    def encode(self, value: Any, text: bytes | None = None, record: str | None = None) -> bytes:
        """The framed record of ``value`` (``text``: the same value as JSON text, when the
        caller has it). Raises ``SchemaMismatch``."""

    def check(self, value: Any, record: str | None = None) -> None:
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

    def encode(self, value: Any, text: bytes | None = None, record: str | None = None) -> bytes:
        return self._write(value)

    def check(self, value: Any, record: str | None = None) -> None:
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

    def check(self, value: Any, record: str | None = None) -> None:
        error = self._best_match(self._validator.iter_errors(value))
        if error is not None:
            path = "/".join(str(p) for p in error.absolute_path) or "(the event)"
            where = f" (subject {self.schema.subject!r})" if self.schema.subject else ""
            raise SchemaMismatch(
                f"does not match JSON Schema id {self.schema.id}{where}: at {path}: {error.message}"
            )

    def encode(self, value: Any, text: bytes | None = None, record: str | None = None) -> bytes:
        self.check(value)
        if text is None:
            text = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
        return self._prefix + text

    def decode(self, body: bytes) -> Any:
        return json.loads(body)


# Protobuf. A registered schema is .proto source; encoding needs its descriptors. Three ways
# were tried against the tests' registry (Apicurio Registry 3.0.9, ccompat API): asking it
# for the compiled FileDescriptorProto (Confluent's ``?format=serialized``) returns the
# source text again, so that is not portable; a pure-Python .proto parser would leave name
# resolution, maps, oneofs, options and the well-known types to a translation of our own;
# grpcio-tools carries protoc itself as an extension module (no binary on PATH, no
# subprocess), with the well-known types' .proto files. So protoc compiles the text, once per
# distinct schema text in this process (_compiled).
_SCHEMA_FILE = "registered_schema.proto"
_COMPILE_CACHE = 64


@functools.lru_cache(maxsize=_COMPILE_CACHE)
def _compiled(text: str) -> bytes | str:
    """The ``FileDescriptorSet`` (serialized; the schema's file last, after its imports) of
    .proto source, or protoc's errors (a bad schema is cached too: compiled once)."""
    import grpc_tools
    from grpc_tools import protoc

    includes = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    with tempfile.TemporaryDirectory(prefix="notify-outbox-proto-") as work:
        with open(os.path.join(work, _SCHEMA_FILE), "w", encoding="utf-8") as source:
            source.write(text)
        out = os.path.join(work, "descriptors.pb")
        status = protoc.main(
            [
                "protoc",
                f"--proto_path={work}",
                f"--proto_path={includes}",
                f"--descriptor_set_out={out}",
                "--include_imports",
                _SCHEMA_FILE,
            ]
        )
        if status == 0:
            with open(out, "rb") as result:
                return result.read()
        return _protoc_errors(work, includes)


def _protoc_errors(work: str, includes: str) -> str:
    """protoc's errors for the schema in ``work``: ``protoc.main`` prints them to the
    process's stderr only; the module's ``get_protos`` (not documented) raises them."""
    try:
        from grpc_tools import _protoc_compiler

        _protoc_compiler.get_protos(_SCHEMA_FILE.encode(), [work.encode(), includes.encode()])
    except Exception as e:  # ProtocErrors, or whatever a new version raises
        found = getattr(e, "errors", None)
        if callable(found):
            return "; ".join(_protoc_error(err) for err in found())
        return str(e)
    return "protoc refused it"


def _protoc_error(error: Any) -> str:
    """One of protoc's errors: the line and column (0-based there) in the schema, else the
    file it is about (an import)."""
    message = _text(error.message).rstrip(".")
    filename = _text(error.filename)
    if error.line >= 0 and filename == _SCHEMA_FILE:
        return f"line {error.line + 1}:{error.column + 1}: {message}"
    return f"{filename}: {message}"


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _zigzag(out: bytearray, value: int) -> None:
    value = (value << 1) ^ (value >> 63)
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def message_indexes(path: Sequence[int]) -> bytes:
    """Confluent's message indexes of the message at ``path`` (its index among the file's
    top-level messages, then among each parent's nested ones): a zig-zag varint count, then
    each index; the first message of the file (``[0]``) is the single byte 0."""
    if list(path) == [0]:
        return b"\x00"
    out = bytearray()
    _zigzag(out, len(path))
    for index in path:
        _zigzag(out, index)
    return bytes(out)


def read_message_indexes(body: bytes) -> tuple[list[int], int]:
    """The message indexes at the start of a Protobuf record's body and where the message
    starts. Raises ``ValueError`` on a truncated array."""
    position = 0

    def varint() -> int:
        nonlocal position
        shift = result = 0
        while True:
            if position >= len(body) or shift > 63:
                raise ValueError("truncated Protobuf message indexes")
            byte = body[position]
            position += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return (result >> 1) ^ -(result & 1)
            shift += 7

    count = varint()
    if count < 0:
        raise ValueError("invalid Protobuf message indexes")
    path = [varint() for _ in range(count)] if count else [0]
    return path, position


class ProtobufCodec:
    """Protobuf: JSON events become messages of the registered .proto schema (compiled at run
    time, see ``_compiled``), by the proto3 JSON mapping (``json_format``), strictly: a field
    the message does not have, a wrong type or a missing proto2 ``required`` field is a
    mismatch. The message is the file's first unless ``record`` names another (its full name,
    or the simple name of a top-level one). Imports of the well-known types
    (``google/protobuf/*.proto``) work; imports of other registered schemas (references) do
    not: ``UnsupportedSchema``."""

    def __init__(self, schema: RegisteredSchema) -> None:
        from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory

        self.schema = schema
        compiled = _compiled(schema.schema)
        if isinstance(compiled, str):
            hint = ""
            if "not found" in compiled or "Import" in compiled:
                hint = (
                    " (imports other than the well-known google/protobuf/*.proto, i.e. schema "
                    "references, are not supported)"
                )
            raise UnsupportedSchema(
                f"schema {schema.id} is not a Protobuf schema protoc compiles: {compiled}{hint}"
            )
        files = descriptor_pb2.FileDescriptorSet.FromString(compiled).file
        # A pool per codec: two schemas (two versions of a subject) may declare the same names.
        pool = descriptor_pool.DescriptorPool()
        for file in files:
            pool.Add(file)
        self._file = pool.FindFileByName(_SCHEMA_FILE)
        if not self._file.message_types_by_name:
            raise UnsupportedSchema(f"schema {schema.id} declares no Protobuf message")
        self._json = json_format
        self._classes = message_factory.GetMessageClass
        # Per record name (None: the first message): the message class and the record's prefix
        # (magic byte, id, message indexes), so an event pays no lookup.
        self._messages: dict[str | None, tuple[type[Message], bytes]] = {}
        # Per message-indexes prefix of a body: the class (decoding).
        self._by_indexes: dict[bytes, type[Message]] = {}
        first = next(iter(self._file.message_types_by_name.values()))
        self._messages[None] = self._entry(first)

    def _entry(self, descriptor: Descriptor) -> tuple[type[Message], bytes]:
        path: list[int] = []
        node = descriptor
        while node.containing_type is not None:
            path.insert(0, list(node.containing_type.nested_types).index(node))
            node = node.containing_type
        path.insert(0, list(self._file.message_types_by_name.values()).index(node))
        return self._classes(descriptor), frame(self.schema.id, message_indexes(path))

    def _describe(self) -> str:
        where = f" (subject {self.schema.subject!r})" if self.schema.subject else ""
        return f"id {self.schema.id}{where}"

    def _message(self, record: str | None) -> tuple[type[Message], bytes]:
        found = self._messages.get(record)
        if found is not None:
            return found
        assert record is not None
        pool = self._file.pool
        descriptor = None
        try:
            candidate = pool.FindMessageTypeByName(record)
            if candidate.file is self._file:
                descriptor = candidate
        except KeyError:
            descriptor = self._file.message_types_by_name.get(record.rsplit(".", 1)[-1])
        if descriptor is None:
            names = ", ".join(m.full_name for m in self._file.message_types_by_name.values())
            raise SchemaMismatch(
                f"does not match Protobuf schema {self._describe()}: it declares no message "
                f"{record!r} (the event_type names the record; it has {names})"
            )
        found = self._messages[record] = self._entry(descriptor)
        return found

    def _build(self, value: Any, record: str | None) -> tuple[Message, bytes]:
        cls, prefix = self._message(record)
        name = cls.DESCRIPTOR.full_name
        if not isinstance(value, dict):
            raise SchemaMismatch(
                f"does not match Protobuf schema {self._describe()}: message {name} needs a "
                f"JSON object, not {type(value).__name__}"
            )
        try:
            message = self._json.ParseDict(value, cls(), ignore_unknown_fields=False)
        except (self._json.ParseError, ValueError, TypeError, AttributeError) as e:
            reason = " ".join(str(e).split())
            raise SchemaMismatch(
                f"does not match Protobuf schema {self._describe()} (message {name}): {reason}"
            ) from None
        if not message.IsInitialized():
            # Not in the stubs, in both runtimes (upb and pure Python): the fields' paths.
            missing = message.FindInitializationErrors()  # type: ignore[attr-defined]
            raise SchemaMismatch(
                f"does not match Protobuf schema {self._describe()} (message {name}): missing "
                f"required field(s) {', '.join(missing)}"
            )
        return message, prefix

    def encode(self, value: Any, text: bytes | None = None, record: str | None = None) -> bytes:
        message, prefix = self._build(value, record)
        return prefix + message.SerializeToString()

    def check(self, value: Any, record: str | None = None) -> None:
        self._build(value, record)

    def decode(self, body: bytes) -> Any:
        """The message as a dict (the proto3 JSON mapping: the .proto's field names, every
        field without presence, 64-bit integers as strings)."""
        path, start = read_message_indexes(body)
        key = body[:start]
        cls = self._by_indexes.get(key)
        if cls is None:
            try:
                descriptor = list(self._file.message_types_by_name.values())[path[0]]
                for index in path[1:]:
                    descriptor = descriptor.nested_types[index]
            except IndexError:
                raise ValueError(
                    f"message indexes {path} name no message of Protobuf schema {self._describe()}"
                ) from None
            cls = self._by_indexes[key] = self._classes(descriptor)
        message = cls.FromString(body[start:])
        return self._json.MessageToDict(
            message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )


def codec_for(schema: RegisteredSchema) -> Codec:
    """The codec of a registered schema: Avro, JSON Schema or Protobuf. Raises
    ``UnsupportedSchema`` for another kind, or a schema that does not compile."""
    kind = schema.schema_type.upper()
    if kind == "AVRO":
        return AvroCodec(schema)
    if kind == "JSON":
        return JsonSchemaCodec(schema)
    if kind == "PROTOBUF":
        return ProtobufCodec(schema)
    raise UnsupportedSchema(
        f"schema {schema.id} is of type {kind}: the relay encodes Avro, JSON Schema and Protobuf"
    )
