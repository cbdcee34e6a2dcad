"""notify-outbox: a transactional outbox relay from PostgreSQL to Apache Kafka.

Producers write events into the outbox table inside their own transaction (``enqueue`` or a
plain ``INSERT``); a trigger NOTIFYs the relay at commit; the relay claims the rows with
``FOR UPDATE SKIP LOCKED``, publishes them to Kafka and marks them only after the broker
acknowledged. A slow fallback poll catches any missed notification.
"""

# The one place the version is written: pyproject reads it ([tool.hatch.version]) and
# `notify-outbox --version` prints it.
__version__ = "0.1.0"

from .core.errors import (
    ConfigurationError,
    EventValidationError,
    MigrationError,
    NotifyOutboxError,
    PublisherUnavailable,
)
from .core.events import RelayEvents
from .core.names import OutboxNames
from .core.outbox import BatchOutcome, ClaimedBatch, OutboxRow, OutboxStore
from .core.settings import DatabaseSettings, OutboxSettings, load_settings
from .kafka.publisher import KafkaPublisher, Publisher, PublishResult
from .pg.migrations import VerifyReport, migrate, render_migrations, verify
from .pg.store import PgOutboxStore
from .producer.enqueue import OutboxEvent, enqueue, enqueue_many
from .relay.fleet import Fleet, FleetDatabase
from .relay.relay import Relay

__all__ = [
    "BatchOutcome",
    "ClaimedBatch",
    "ConfigurationError",
    "DatabaseSettings",
    "EventValidationError",
    "Fleet",
    "FleetDatabase",
    "KafkaPublisher",
    "MigrationError",
    "NotifyOutboxError",
    "OutboxEvent",
    "OutboxNames",
    "OutboxRow",
    "OutboxSettings",
    "OutboxStore",
    "PgOutboxStore",
    "PublishResult",
    "Publisher",
    "PublisherUnavailable",
    "Relay",
    "RelayEvents",
    "VerifyReport",
    "enqueue",
    "enqueue_many",
    "load_settings",
    "migrate",
    "render_migrations",
    "verify",
]
