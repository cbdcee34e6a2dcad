"""A claim's COMMIT begins the next claim's transaction (``PgOutboxStore(prime=True)``), against a
real PostgreSQL: the next claim skips its BEGIN, the waiting transaction holds nothing (no
snapshot, no transaction id, no lock), sees every row committed after it began, and goes back to
the pool soon, or when the store closes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import asyncpg
import pytest

from notify_outbox import OutboxNames
from notify_outbox.pg.sqlfiles import Queries
from notify_outbox.pg.store import PRIME_TTL, BatchOutcome, PgOutboxStore
from tests.faults.harness import connect

pytestmark = pytest.mark.anyio

APP = "prime-test"
INSERT = "INSERT INTO outbox (topic, key, payload) VALUES ('t', $1, '{}') RETURNING id"


class Statements:
    """Every statement the pool's connections send, in order (asyncpg's query logger)."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def init(self, conn: asyncpg.Connection) -> None:
        conn.add_query_logger(lambda q: self.sent.append(q.query))


@pytest.fixture
async def pool_and_log(db_dsn: str) -> AsyncIterator[tuple[asyncpg.Pool, Statements]]:
    log = Statements()
    pool = await asyncpg.create_pool(
        db_dsn, min_size=1, max_size=2, init=log.init, server_settings={"application_name": APP}
    )
    try:
        yield pool, log
    finally:
        with anyio.fail_after(10):  # close() waits for every connection to come back
            await pool.close()


@pytest.fixture
async def admin(db_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A session of the test's own: inserts rows, and reads the workers' sessions."""
    async with connect(db_dsn) as conn:
        yield conn


def _store(pool: asyncpg.Pool, *, prime: bool = True, prime_ttl: float = 60.0) -> PgOutboxStore:
    # A long wait by default (a claim's idle timeout bounds it: half of _claim_and_publish's),
    # so that a loaded host's delays cannot end it before a test looks at it.
    return PgOutboxStore(
        pool,
        Queries(OutboxNames()),
        delete_on_publish=False,
        command_timeout=10,
        prime=prime,
        prime_ttl=prime_ttl,
    )


async def _claim_and_publish(store: PgOutboxStore, idle_timeout: float = 120.0) -> list[int]:
    async with store.claim(100, idle_timeout) as batch:
        ids = [r.id for r in batch.rows]
        await batch.complete(BatchOutcome(published=ids))
    return ids


async def _worker_sessions(admin: asyncpg.Connection) -> list[asyncpg.Record]:
    return await admin.fetch(
        "SELECT pid, state, backend_xid, backend_xmin FROM pg_stat_activity "
        "WHERE application_name = $1 AND datname = current_database()",
        APP,
    )


async def test_the_next_claim_starts_without_a_begin_in_a_transaction_that_holds_nothing(
    admin: asyncpg.Connection, pool_and_log: tuple[asyncpg.Pool, Statements]
) -> None:
    pool, log = pool_and_log
    store = _store(pool)
    first = await admin.fetchval(INSERT, "a")
    assert await _claim_and_publish(store) == [first]
    # The claim's COMMIT began the next transaction: the session waits in it, and holds
    # no transaction id and no snapshot (it must not hold back vacuum, nor the mark).
    sessions = await _worker_sessions(admin)
    waiting = [s for s in sessions if s["state"] == "idle in transaction"]
    assert len(waiting) == 1, sessions
    assert waiting[0]["backend_xid"] is None
    assert waiting[0]["backend_xmin"] is None
    # A row committed after that transaction began is claimed by it (READ COMMITTED: each
    # of the claim's statements takes its own snapshot).
    second = await admin.fetchval(INSERT, "a")
    sent_before = len(log.sent)
    assert await _claim_and_publish(store) == [second]
    claim_statements = log.sent[sent_before:]
    assert not any(q.startswith("BEGIN") for q in claim_statements[:1]), claim_statements
    assert "_claim(" in claim_statements[0], claim_statements
    # The first claim's BEGIN came in a statement of its own; the second rode on the
    # first's COMMIT.
    begins = [q for q in log.sent if q.startswith("BEGIN")]
    assert len(begins) == 1, log.sent
    assert any("COMMIT;\nBEGIN ISOLATION LEVEL READ COMMITTED" in q for q in log.sent)
    await store.close()


async def test_a_primed_transaction_is_rolled_back_and_its_connection_returned_soon(
    admin: asyncpg.Connection, pool_and_log: tuple[asyncpg.Pool, Statements]
) -> None:
    pool, _ = pool_and_log
    store = _store(pool, prime_ttl=PRIME_TTL)
    await admin.fetchval(INSERT, "a")
    await _claim_and_publish(store)
    primed_at = time.monotonic()
    # Waits on the server's own account of the session (which has no event to wait on),
    # not on a sleep of PRIME_TTL.
    with anyio.fail_after(5):
        while any(  # noqa: ASYNC110
            s["state"] != "idle" for s in await _worker_sessions(admin)
        ):
            await anyio.sleep(0.005)
    assert time.monotonic() - primed_at >= PRIME_TTL * 0.9
    # Back in the pool: both of its connections can be taken at once.
    async with pool.acquire(timeout=1), pool.acquire(timeout=1):
        pass
    # A claim now sends its own BEGIN (nothing is primed any more), and still works.
    row = await admin.fetchval(INSERT, "b")
    assert await _claim_and_publish(store) == [row]
    await store.close()


async def test_closing_the_store_rolls_back_primed_transactions(
    admin: asyncpg.Connection, pool_and_log: tuple[asyncpg.Pool, Statements]
) -> None:
    pool, _ = pool_and_log
    store = _store(pool)
    await admin.fetchval(INSERT, "a")
    # An idle timeout long enough that only close() can end the wait in time.
    await _claim_and_publish(store, idle_timeout=600)
    assert any(s["state"] == "idle in transaction" for s in await _worker_sessions(admin))
    await store.close()
    assert all(s["state"] == "idle" for s in await _worker_sessions(admin))
    # (The fixture's pool.close() then returns at once; it would wait otherwise.)


async def test_without_prime_every_claim_begins_and_returns_its_connection(
    admin: asyncpg.Connection, pool_and_log: tuple[asyncpg.Pool, Statements]
) -> None:
    pool, log = pool_and_log
    store = _store(pool, prime=False)
    for key in ("a", "b"):
        row = await admin.fetchval(INSERT, key)
        assert await _claim_and_publish(store) == [row]
        assert all(s["state"] == "idle" for s in await _worker_sessions(admin))
    assert len([q for q in log.sent if q.startswith("BEGIN")]) == 2
