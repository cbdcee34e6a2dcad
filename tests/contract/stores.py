"""The stores that ``test_store_contract.py`` holds to one contract, each behind a small harness:
how to write a row, read back what became of it, and move the store's time forward.

``FakeStore`` (the unit tests' fake) and ``PgOutboxStore`` on a real, migrated database, as the
relay opens it (with ``prime``, and without, as behind a transaction pooler). A store the relay
can run on gets a harness here and a name in ``STORES``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal, Protocol

import asyncpg

from notify_outbox import OutboxNames
from notify_outbox.core.outbox import OutboxStore
from notify_outbox.pg.sqlfiles import Queries
from notify_outbox.pg.store import PgOutboxStore
from tests.fakes import FakeStore

#: The stores, as test ids; the ones that need PostgreSQL start with "pg".
STORES = ("fake", "pg", "pg-unprimed")


@dataclass(frozen=True)
class RowState:
    """What became of a row, as its store keeps it."""

    status: Literal["pending", "published", "dead"]
    attempts: int
    #: The error of its latest failure (a dead letter's: why it was dead-lettered).
    error: str | None


class Harness(Protocol):
    store: OutboxStore

    async def add(self, key: str | None = None, topic: str = "t") -> int:
        """Write a committed row; its id."""
        ...

    async def state(self, row_id: int) -> RowState | None:
        """What became of the row (None: deleted)."""
        ...

    async def advance(self, seconds: float) -> None:
        """Move the store's time forward: retries come due, published rows age."""
        ...


class FakeHarness:
    def __init__(self) -> None:
        self.fake = FakeStore()
        self.store: OutboxStore = self.fake

    async def add(self, key: str | None = None, topic: str = "t") -> int:
        return self.fake.add(topic=topic, key=key)

    async def state(self, row_id: int) -> RowState | None:
        r = self.fake.rows.get(row_id)
        if r is None:
            return None
        if r.dead is not None:
            return RowState("dead", r.row.attempts, r.dead)
        status: Literal["pending", "published"] = "published" if r.published else "pending"
        return RowState(status, r.row.attempts, r.errors[-1] if r.errors else None)

    async def advance(self, seconds: float) -> None:
        self.fake.now += seconds


class PgHarness:
    """``PgOutboxStore`` on the default outbox of a migrated database. Rows are written, read
    and aged through a connection of the test's own (never the store's pool); time moves by
    moving the rows' timestamps back, not by sleeping."""

    def __init__(self, conn: asyncpg.Connection, store: PgOutboxStore) -> None:
        self._conn = conn
        self.store: OutboxStore = store

    async def add(self, key: str | None = None, topic: str = "t") -> int:
        row_id: int = await self._conn.fetchval(
            "INSERT INTO outbox (topic, key, payload) VALUES ($1, $2, '{}') RETURNING id",
            topic,
            key,
        )
        return row_id

    async def state(self, row_id: int) -> RowState | None:
        row = await self._conn.fetchrow(
            "SELECT published_at IS NOT NULL AS published, attempts, last_error "
            "FROM outbox WHERE id = $1",
            row_id,
        )
        if row is not None:
            status: Literal["pending", "published"] = "published" if row["published"] else "pending"
            return RowState(status, row["attempts"], row["last_error"])
        dead = await self._conn.fetchrow(
            "SELECT attempts, error FROM outbox_dead_letter WHERE id = $1", row_id
        )
        return None if dead is None else RowState("dead", dead["attempts"], dead["error"])

    async def advance(self, seconds: float) -> None:
        # 'infinity' (a parked row) stays 'infinity'.
        await self._conn.execute(
            "UPDATE outbox SET next_attempt_at = next_attempt_at - make_interval(secs => $1), "
            "published_at = published_at - make_interval(secs => $1) "
            "WHERE next_attempt_at IS NOT NULL OR published_at IS NOT NULL",
            seconds,
        )
        await self._conn.execute(
            "UPDATE outbox_dead_letter "
            "SET dead_lettered_at = dead_lettered_at - make_interval(secs => $1)",
            seconds,
        )


@asynccontextmanager
async def open_harness(kind: str, dsn: str | None) -> AsyncIterator[Harness]:
    """The harness of ``kind`` (one of ``STORES``); ``dsn``: a migrated database for the
    PostgreSQL ones (its outbox is emptied first)."""
    if kind == "fake":
        yield FakeHarness()
        return
    assert dsn is not None
    conn = await asyncpg.connect(dsn)
    # The database is the test module's: every case starts from an empty outbox.
    await conn.execute("TRUNCATE outbox, outbox_dead_letter RESTART IDENTITY")
    # Room for two claims at once and a look beside them.
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    store = PgOutboxStore(
        pool,
        Queries(OutboxNames()),
        delete_on_publish=False,
        command_timeout=10,
        prime=kind == "pg",
    )
    try:
        yield PgHarness(conn, store)
    finally:
        await store.close()
        await conn.close()
        await pool.close()
