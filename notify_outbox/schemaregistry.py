"""Schema Registry support (``notify_outbox.kafka.registry``): ``EventSchemas`` and
``StaticSchema`` for producers (``enqueue(..., schemas=...)``), ``RegistryDeserializer`` for
consumers (``consume_batches(..., deserializer=...)``), and the client and errors. The relay
encodes governed topics itself (``NOTIFY_OUTBOX_SCHEMA_REGISTRY_URL``). Needs the
``schema-registry`` extra.
"""

from notify_outbox.kafka.registry import (
    EventSchemas,
    EventToCheck,
    RegisteredSchema,
    RegistryClient,
    RegistryDeserializer,
    RegistryError,
    RegistryRefused,
    RegistryUnavailable,
    RowEncoder,
    SchemaCheck,
    SchemaIncompatible,
    SchemaMismatch,
    StaticSchema,
    SubjectNotFound,
    SubjectStrategy,
    UnsupportedSchema,
    frame,
    subject_name,
    unframe,
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
