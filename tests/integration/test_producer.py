"""The producer side against a real PostgreSQL: enqueue (asyncpg and SQLAlchemy), the
validation that keeps poison out, and the per-key ordering trigger."""

from __future__ import annotations

import json

import anyio
import asyncpg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from notify_outbox import EventValidationError, OutboxEvent, enqueue, enqueue_many
from notify_outbox.producer.sqlalchemy import enqueue as sa_enqueue
from notify_outbox.producer.sqlalchemy import enqueue_async as sa_enqueue_async
from tests.faults.harness import eventually

pytestmark = pytest.mark.anyio


async def test_enqueue_commits_and_rolls_back_with_the_caller(db_dsn: str) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        async with conn.transaction():
            event_id = await enqueue(
                conn,
                topic="orders",
                key="order-1",
                payload={"total": 10, "items": ["a"]},
                headers={"source": "test"},
                event_type="OrderPlaced",
                aggregate_type="order",
                aggregate_id="1",
                idempotency_key="order-1-placed",
            )
        tx = conn.transaction()
        await tx.start()
        await enqueue(conn, topic="orders", key="order-2", payload={})
        await tx.rollback()  # the business change failed
        rows = await conn.fetch("SELECT * FROM outbox")
        assert len(rows) == 1
        row = rows[0]
        assert row["event_id"] == event_id
        assert json.loads(row["payload"]) == {"total": 10, "items": ["a"]}
        assert json.loads(row["headers"]) == {"source": "test"}
        assert (row["event_type"], row["aggregate_type"], row["aggregate_id"]) == (
            "OrderPlaced",
            "order",
            "1",
        )
        # The idempotency key is unique while the row is in the outbox.
        with pytest.raises(asyncpg.UniqueViolationError):
            await enqueue(conn, topic="orders", payload={}, idempotency_key="order-1-placed")
    finally:
        await conn.close()


async def test_enqueue_many_returns_ids_in_given_order(db_dsn: str) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        events = [OutboxEvent(topic="t", key=k, payload={"i": i}) for i, k in enumerate("zyxzy")]
        events.append(OutboxEvent(topic="t", value_bytes=b"\x00\x01raw", key=None))
        ids = await enqueue_many(conn, events)
        rows = await conn.fetch("SELECT event_id, key, payload, payload_bytes FROM outbox")
        by_id = {r["event_id"]: r for r in rows}
        assert [by_id[i]["key"] for i in ids] == [*"zyxzy", None]
        assert [json.loads(by_id[i]["payload"])["i"] for i in ids[:5]] == [0, 1, 2, 3, 4]
        assert by_id[ids[5]]["payload_bytes"] == b"\x00\x01raw"
        # Within a key, insertion order (and so relay order) is the order given.
        z_rows = await conn.fetch("SELECT payload FROM outbox WHERE key = 'z' ORDER BY id")
        assert [json.loads(r["payload"])["i"] for r in z_rows] == [0, 3]
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"topic": "bad topic", "payload": {}}, "topic must be"),
        ({"topic": "t", "payload": {1, 2}}, "not JSON-serializable"),
        ({"topic": "t", "payload": float("nan")}, "not JSON-serializable"),
        ({"topic": "t", "payload": "x" * 2_000_000}, "over the limit"),
        ({"topic": "t", "payload": {}, "key": 42}, "key must be a str"),
        ({"topic": "t", "payload": {}, "headers": {"a": 1}}, "mapping of str to str"),
        ({"topic": "t", "payload": {}, "headers": {"outbox-event-id": "x"}}, "reserved"),
        ({"topic": "t"}, "needs a key"),
        ({"topic": "t", "payload": {}, "value_bytes": b"x"}, "not both"),
    ],
)
async def test_bad_events_are_rejected_before_touching_the_database(
    db_dsn: str, kwargs: dict[str, object], message: str
) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        with pytest.raises(EventValidationError, match=message):
            await enqueue(conn, **kwargs)  # type: ignore[arg-type]
        assert await conn.fetchval("SELECT count(*) FROM outbox") == 0
    finally:
        await conn.close()


async def test_same_key_writers_are_serialized_so_ids_follow_commit_order(db_dsn: str) -> None:
    """The BEFORE INSERT trigger locks the key before drawing the id: a second transaction
    writing the same key waits for the first to finish; other keys do not wait. And the id is
    drawn after that wait: a writer that took its default id first but reached the key's lock
    last gets an id above the row committed before it (id order is commit order)."""
    first = await asyncpg.connect(db_dsn)
    second = await asyncpg.connect(db_dsn)
    control = await asyncpg.connect(db_dsn)
    try:
        tx = first.transaction()
        await tx.start()
        first_k = await first.fetchval(
            "INSERT INTO outbox (topic, key, payload) VALUES ('t', 'k', '{}') RETURNING id"
        )
        await second.execute("SET lock_timeout = '200ms'")
        with pytest.raises(asyncpg.LockNotAvailableError):
            await second.execute("INSERT INTO outbox (topic, key, payload) VALUES ('t', 'k', '{}')")
        await second.execute("INSERT INTO outbox (topic, key, payload) VALUES ('t', 'j', '{}')")
        await tx.commit()
        await second.execute("RESET lock_timeout")
        second_k = await second.fetchval(
            "INSERT INTO outbox (topic, key, payload) VALUES ('t', 'k', '{}') RETURNING id"
        )

        # A test trigger that fires before the ordering one (triggers fire in name order) holds
        # rows whose payload says so on an advisory lock of the test's: such a row has drawn its
        # default id but not reached the key's lock yet.
        await control.execute(
            "CREATE FUNCTION test_hold() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.payload ? 'hold' THEN PERFORM pg_advisory_xact_lock_shared(-4242, -4242); "
            "END IF; RETURN NEW; END $$"
        )
        await control.execute(
            "CREATE TRIGGER outbox_a_hold BEFORE INSERT ON outbox "
            "FOR EACH ROW EXECUTE FUNCTION test_hold()"
        )
        await control.execute("SELECT pg_advisory_lock(-4242, -4242)")
        late: list[int] = []
        async with anyio.create_task_group() as tg:

            async def held_writer() -> None:
                late.append(
                    await second.fetchval(
                        "INSERT INTO outbox (topic, key, payload) "
                        """VALUES ('t', 'm', '{"hold": true}') RETURNING id"""
                    )
                )

            tg.start_soon(held_writer)

            async def held() -> bool:
                wait = await control.fetchval(
                    "SELECT wait_event FROM pg_stat_activity WHERE pid = $1",
                    second.get_server_pid(),
                )
                return bool(wait == "advisory")

            await eventually(held, within=30, what="the held writer waits on the test's lock")
            early = await first.fetchval(
                "INSERT INTO outbox (topic, key, payload) VALUES ('t', 'm', '{}') RETURNING id"
            )
            await control.execute("SELECT pg_advisory_unlock(-4242, -4242)")
        # Both committed, ``early`` first: in id order, ``early`` comes first too.
        ids = [
            r["id"]
            for r in await control.fetch("SELECT id FROM outbox WHERE key = 'm' ORDER BY id")
        ]
        assert ids == [early, late[0]], "the later commit of key m got the lower id"
        ids = [
            r["id"]
            for r in await control.fetch("SELECT id FROM outbox WHERE key = 'k' ORDER BY id")
        ]
        assert ids == [first_k, second_k]
    finally:
        await first.close()
        await second.close()
        await control.close()


def _sqlalchemy_url(dsn: str, driver: str) -> str:
    return dsn.replace("postgresql://", f"postgresql+{driver}://", 1)


def test_sqlalchemy_session_enqueue(db_dsn: str) -> None:
    engine = create_engine(_sqlalchemy_url(db_dsn, "psycopg"))
    try:
        with Session(engine) as session, session.begin():
            event_id = sa_enqueue(session, topic="orders", key="o-1", payload={"n": 1})
        with Session(engine) as session:
            session.begin()
            sa_enqueue(session, topic="orders", key="o-2", payload={"n": 2})
            session.rollback()
            rows = session.execute(text("SELECT event_id, payload FROM outbox")).all()
        assert [(r.event_id, r.payload) for r in rows] == [(event_id, {"n": 1})]
    finally:
        engine.dispose()


async def test_sqlalchemy_async_session_enqueue(db_dsn: str) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession

    engine = create_async_engine(_sqlalchemy_url(db_dsn, "asyncpg"))
    try:
        async with AsyncSession(engine) as session, session.begin():
            event_id = await sa_enqueue_async(
                session, topic="orders", key="o-1", payload={"n": 1}, headers={"h": "v"}
            )
        async with AsyncSession(engine) as session:
            rows = (await session.execute(text("SELECT event_id, headers FROM outbox"))).all()
        # The asyncpg dialect decodes jsonb itself.
        assert [(r.event_id, r.headers) for r in rows] == [(event_id, {"h": "v"})]
    finally:
        await engine.dispose()
