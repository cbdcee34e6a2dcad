"""The outbox as the relay sees it: a claimed row, what to write back for a batch, and the
store's port.

Plain types and protocols, apart from any adapter, so that the relay's policy, its events, tracing
and the publisher name them without importing the PostgreSQL store (``pg/store.py`` implements
``OutboxStore``; the unit tests' fake does too).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

__all__ = ["BatchOutcome", "ClaimedBatch", "OutboxRow", "OutboxStore"]


@dataclass(slots=True)
class OutboxRow:
    """A claimed outbox row, as the publisher needs it. Treat it as read-only. (Not a
    frozen dataclass: its ``__init__`` sets each field through ``object.__setattr__``, 7x
    the cost of a plain one, once per claimed row.)"""

    id: int
    event_id: uuid.UUID
    topic: str
    key: str | None
    payload: str | None  # jsonb as JSON text
    payload_bytes: bytes | None
    headers: str | None  # jsonb object as JSON text
    event_type: str | None = None
    aggregate_type: str | None = None
    aggregate_id: str | None = None
    attempts: int = 0
    # When the producer's transaction inserted it (for the commit-to-ack metric); None when
    # unknown (the claim's look-up raced a commit, or a fake store).
    created_at: datetime | None = None


@dataclass
class BatchOutcome:
    """What to write back for a claimed batch. Rows in none of the lists stay pending as they
    were (for example the rows held back behind a failed row of the same key)."""

    published: list[int] = field(default_factory=list)
    retry: list[tuple[int, str, float]] = field(default_factory=list)  # id, error, delay (s)
    dead: list[tuple[int, str]] = field(default_factory=list)  # id, error


class ClaimedBatch(Protocol):
    """Rows locked by one claim; ``complete`` writes the outcome before the claim commits."""

    @property
    def rows(self) -> Sequence[OutboxRow]: ...

    @property
    def more_due(self) -> bool | None:
        """After ``complete``: whether rows were due right after the commit (None: unknown,
        claim again to find out)."""
        ...

    @property
    def busy(self) -> int:
        """Buckets with fresh rows that other claims held (their rows were not taken)."""
        ...

    @property
    def parked(self) -> bool:
        """Whether the claim moved rows aside (migration 0006: rows held back behind a failed
        row of their key), which it does a chunk at a time: claim again, even with no rows."""
        ...

    async def complete(self, outcome: BatchOutcome) -> None: ...

    async def keepalive(self) -> None:
        """Tell the database the claim is still being worked on (a claim left idle for the
        claim's ``idle_timeout`` is ended by the server)."""
        ...

    def idle(self) -> float:
        """Seconds since the claim's last statement was sent: at least as long as the server
        may have seen it idle."""
        ...


class OutboxStore(Protocol):
    """The database operations the relay needs (a port, so tests can use a fake)."""

    def claim(
        self, limit: int, idle_timeout: float | None = None
    ) -> AbstractAsyncContextManager[ClaimedBatch]:
        """Lock up to ``limit`` due rows in per-key commit order until the context exits;
        the database ends the claim if it is left idle for ``idle_timeout`` seconds."""
        ...

    async def has_due(self) -> bool:
        """Whether a claim would get something (rows waiting for their retry time, and rows
        queued behind them, do not count), without locking anything."""
        ...

    async def poll(self) -> tuple[bool, float | None]:
        """The fallback poll's look, in one statement: ``has_due``, and the seconds until the
        earliest retry that is not due yet (None if there is none)."""
        ...

    async def count_pending(self, limit: int) -> int:
        """Pending rows, counted up to ``limit``."""
        ...

    async def delete_expired(self, older_than: float, limit: int) -> int:
        """Delete up to ``limit`` rows published more than ``older_than`` seconds ago."""
        ...

    async def expire_dead_letters(self, older_than: float, limit: int) -> int:
        """Delete the dead letters dead-lettered more than ``older_than`` seconds ago,
        ``limit`` per statement; returns how many."""
        ...

    async def notify(self, channel: str, payload: str) -> None:
        """NOTIFY ``channel`` through the store's connections (the listener's proof that
        what producers send reaches it)."""
        ...
