"""Schema Registry support: events checked against their topic's schema before the
producer's commit, encoded by the relay in Confluent's wire format (Avro, JSON Schema,
Protobuf), and decoded by consumers. Needs the ``schema-registry`` extra (httpx, fastavro,
jsonschema, orjson, protobuf, grpcio-tools), each imported only when used (protobuf and
grpcio-tools: for a Protobuf schema). Users import it as ``notify_outbox.schemaregistry``.
"""

from notify_outbox.kafka.registry.client import (
    RegisteredSchema,
    RegistryClient,
    RegistryError,
    RegistryRefused,
    RegistryUnavailable,
    SchemaIncompatible,
    SubjectNotFound,
)
from notify_outbox.kafka.registry.codecs import (
    SchemaMismatch,
    UnsupportedSchema,
    frame,
    unframe,
)
from notify_outbox.kafka.registry.serde import (
    EventSchemas,
    EventToCheck,
    RegistryDeserializer,
    RowEncoder,
    SchemaCheck,
    StaticSchema,
    SubjectStrategy,
    subject_name,
)

__all__ = [
    "EventSchemas",
    "EventToCheck",
    "RegisteredSchema",
    "RegistryClient",
    "RegistryDeserializer",
    "RegistryError",
    "RegistryRefused",
    "RegistryUnavailable",
    "RowEncoder",
    "SchemaCheck",
    "SchemaIncompatible",
    "SchemaMismatch",
    "StaticSchema",
    "SubjectNotFound",
    "SubjectStrategy",
    "UnsupportedSchema",
    "frame",
    "subject_name",
    "unframe",
]
