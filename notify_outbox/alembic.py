"""Moved to ``notify_outbox.producer.alembic``; this module re-exports its public names."""

from .producer.alembic import (
    include_object,
    migrate_connection,
    outbox_table_names,
    upgrade_outbox,
)

__all__ = [
    "include_object",
    "migrate_connection",
    "outbox_table_names",
    "upgrade_outbox",
]
