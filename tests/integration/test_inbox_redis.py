"""The inbox's Redis fast path against a real Redis (Debian's redis-server, see devstack/redis.py)
and a real PostgreSQL: a pre-check only, written after the database commit, and harmless to
lose."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import pytest
import redis.asyncio

from devstack import StackError
from devstack.redis import RedisServer
from notify_outbox.inbox import Inbox, InboxNames, RedisSeen, migrate_inbox

pytestmark = pytest.mark.anyio


@dataclass
class Msg:
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    key: bytes | None = None


def event(eid: str | None = None) -> Msg:
    return Msg([("outbox-event-id", (eid or str(uuid.uuid4())).encode())])


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        server.start()
    except StackError as e:
        pytest.fail(f"no Redis for the fast-path tests: {e}", pytrace=False)
    yield server
    server.stop()


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    if not redis_server.is_running():  # a test before killed it
        redis_server.start()
    c = redis.asyncio.Redis.from_url(
        redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5
    )
    yield c
    await c.aclose()


@pytest.fixture
async def pool(empty_db_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(empty_db_dsn, min_size=1, max_size=2)
    async with p.acquire() as conn:
        await migrate_inbox(conn)
        await conn.execute("CREATE TABLE applied (event_id text NOT NULL)")
    yield p
    await p.close()


def apply_handler(inbox: Inbox) -> Any:
    async def handler(conn: asyncpg.Connection, message: Msg) -> None:
        await conn.execute("INSERT INTO applied VALUES ($1)", inbox.event_id(message))

    return handler


@contextlib.contextmanager
def no_database() -> Iterator[None]:
    """Where the database must not be touched: acquiring a pool's connection fails."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the database was used although Redis had the id")

    # Pool has slots: the method is replaced on the class, for the test's one pool.
    original = asyncpg.Pool.acquire
    asyncpg.Pool.acquire = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        asyncpg.Pool.acquire = original  # type: ignore[method-assign]


async def test_a_seen_id_is_skipped_without_the_database(
    pool: asyncpg.Pool, client: redis.asyncio.Redis
) -> None:
    fast = RedisSeen(client)
    inbox = Inbox(consumer="fast", fast_path=fast)
    msg = event()
    assert await inbox.apply(pool, msg, apply_handler(inbox)) is True
    assert await client.exists(fast.key(inbox, inbox.event_id(msg))) == 1
    # The repeat, with every way into the database closed (the keys' database scope was
    # learned from this pool by the first apply, so the check needs no query).
    with no_database():
        assert await inbox.apply(pool, msg, apply_handler(inbox)) is False
    assert inbox.counts["duplicate_fast"] == 1
    # Another consumer's keys are its own.
    other = Inbox(consumer="other", fast_path=fast)
    assert await other.apply(pool, msg, apply_handler(other)) is True


async def test_redis_learns_an_id_only_after_the_commit(
    pool: asyncpg.Pool, client: redis.asyncio.Redis
) -> None:
    fast = RedisSeen(client)
    inbox = Inbox(fast_path=fast)
    msg = event()
    key = fast.key(inbox, inbox.event_id(msg), await inbox.key_scope(pool))

    async def failing(conn: asyncpg.Connection, message: Msg) -> None:
        await conn.execute("INSERT INTO applied VALUES ($1)", inbox.event_id(message))
        assert await client.exists(key) == 0  # inside the transaction: not yet
        raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError, match="handler failed"):
        await inbox.apply(pool, msg, failing)
    assert await client.exists(key) == 0
    assert await inbox.apply(pool, msg, apply_handler(inbox)) is True
    assert await client.exists(key) == 1
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM applied") == 1


async def test_losing_redis_mid_stream_never_applies_twice(
    pool: asyncpg.Pool, client: redis.asyncio.Redis, redis_server: RedisServer
) -> None:
    fast = RedisSeen(client, timeout=0.3)
    inbox = Inbox(fast_path=fast)
    handler = apply_handler(inbox)
    ids = [str(uuid.uuid4()) for _ in range(60)]
    # Each id delivered three times over the stream; Redis is killed a third of the way
    # through and comes back empty two thirds of the way through.
    stream = [eid for eid in ids for _ in range(3)]
    for i, eid in enumerate(stream):
        if i == len(stream) // 3:
            redis_server.kill()
        if i == 2 * len(stream) // 3:
            redis_server.start()
        await inbox.apply(pool, event(eid), handler)
    # Everything again, with Redis empty for the first third of the ids.
    for eid in ids:
        assert await inbox.apply(pool, event(eid), handler) is False
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT event_id, count(*) AS n FROM applied GROUP BY event_id")
    assert {r["event_id"]: r["n"] for r in rows} == dict.fromkeys(ids, 1)
    assert inbox.counts["applied"] == 60
    assert fast.errors > 0  # Redis really was gone for a while
    assert inbox.counts["duplicate_fast"] > 0  # and useful before and after
    assert inbox.counts["duplicate"] > 0  # the database caught what Redis could not


async def test_two_databases_sharing_one_redis_never_skip_each_others_ids(
    pool: asyncpg.Pool, db_dsn: str, client: redis.asyncio.Redis
) -> None:
    """Two services, each with its own database and the default inbox names and consumer,
    share one Redis: an id one of them applied must not make the other skip it."""
    other = await asyncpg.create_pool(db_dsn, min_size=1, max_size=2)
    try:
        async with other.acquire() as conn:
            await migrate_inbox(conn)
            await conn.execute("CREATE TABLE applied (event_id text NOT NULL)")
        fast = RedisSeen(client)
        here, there = Inbox(fast_path=fast), Inbox(fast_path=fast)
        msg = event()
        assert await here.apply(pool, msg, apply_handler(here)) is True
        assert await there.apply(other, msg, apply_handler(there)) is True
        # The batch path too, and each database still skips its own repeats via Redis.
        batch = [event() for _ in range(5)]

        async def bulk(conn: asyncpg.Connection, messages: list[Any]) -> None:
            ids = [here.event_id(m) for m in messages]
            await conn.execute("INSERT INTO applied SELECT unnest($1::text[])", ids)

        assert (await here.apply_batch(pool, batch, bulk)).applied == 5
        assert (await there.apply_batch(other, batch, bulk)).applied == 5
        with no_database():
            assert (await here.apply_batch(pool, batch, bulk)).duplicates == 5
            assert (await there.apply_batch(other, batch, bulk)).duplicates == 5
        assert here.counts["duplicate_fast"] == there.counts["duplicate_fast"] == 5
        scopes = {await here.key_scope(pool), await there.key_scope(other)}
        assert len(scopes) == 2
        for db in (pool, other):
            async with db.acquire() as conn:
                assert await conn.fetchval("SELECT count(*) FROM applied") == 6
        # Another inbox table in the same database is a scope of its own too.
        names = InboxNames(table="inbox_two")
        async with pool.acquire() as conn:
            await migrate_inbox(conn, names)
        assert await Inbox(names=names).key_scope(pool) not in scopes
    finally:
        await other.close()
