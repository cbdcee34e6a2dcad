"""Schema Registry support (``notify_outbox.kafka.registry``): ``EventSchemas`` and
``StaticSchema`` for producers (``enqueue(..., schemas=...)``), ``RegistryDeserializer`` for
consumers (``consume_batches(..., deserializer=...)``), and the client and errors. The relay
encodes governed topics itself (``NOTIFY_OUTBOX_SCHEMA_REGISTRY_URL``). Needs the
``schema-registry`` extra.
"""

from notify_outbox.kafka.registry import *  # noqa: F403 (this module is that package's face)
from notify_outbox.kafka.registry import __all__ as __all__
