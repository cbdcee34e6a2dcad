"""Moved to ``notify_outbox.pg.store`` (the domain types to ``notify_outbox.core.outbox``); this
module re-exports its public names."""

from .core.outbox import BatchOutcome, ClaimedBatch, OutboxRow, OutboxStore
from .pg.store import LowWaterMark, MarkKeeper, PgOutboxStore

__all__ = [
    "BatchOutcome",
    "ClaimedBatch",
    "LowWaterMark",
    "MarkKeeper",
    "OutboxRow",
    "OutboxStore",
    "PgOutboxStore",
]
