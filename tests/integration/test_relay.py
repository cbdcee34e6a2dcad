"""The relay in-process against real PostgreSQL and Kafka: mapping, rollback, fallback poll,
poison rows, listener loss, retention, embedding and cancellation."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import anyio
import asyncpg
import pytest
from aiokafka.admin import AIOKafkaAdminClient

from notify_outbox import OutboxSettings, Relay, enqueue
from tests.conftest import Services
from tests.faults.harness import eventually
from tests.support import consume, create_topics, header, logged, topic_total

pytestmark = pytest.mark.anyio


def make_settings(db_dsn: str, services: Services, **kw: Any) -> OutboxSettings:
    base: dict[str, Any] = {
        "dsn": db_dsn,
        "kafka_bootstrap_servers": services.bootstrap,
        "workers": 2,
        "poll_interval": 30.0,  # long: these tests must not pass thanks to the poll
    }
    base.update(kw)
    return OutboxSettings(**base)


async def test_plain_sql_rows_become_kafka_messages(
    db_dsn: str, services: Services, topic: str
) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        async with Relay(make_settings(db_dsn, services)) as relay:
            assert relay.pulse is not None, "the pulse is on by default (pulse.py)"
            await conn.execute(
                f"""
                INSERT INTO outbox (topic, key, payload, headers, event_type, aggregate_type,
                                    aggregate_id)
                VALUES ('{topic}', 'order-42', '{{"total": 10}}', '{{"trace": "abc"}}',
                        'OrderPlaced', 'order', '42');
                INSERT INTO outbox (topic, key, payload_bytes)
                    VALUES ('{topic}', NULL, '\\x0001ff');
                INSERT INTO outbox (topic, key) VALUES ('{topic}', 'order-42');  -- a tombstone
                """
            )
            records, _ = await consume(services.bootstrap, topic, expect=3, within=30)
        assert relay.events.counts["wake:notification"] >= 1
        assert relay.events.counts["wake:poll"] == 0
        # Counted once the relay stopped: a late copy cannot come after the count.
        total = await topic_total(services.bootstrap, topic)
    finally:
        await conn.close()
    assert total == 3
    by_value = {r.value: r for r in records}
    order = by_value[b'{"total": 10}']
    assert order.key == b"order-42"
    assert header(order, "trace") == "abc"
    assert header(order, "outbox-event-type") == "OrderPlaced"
    assert header(order, "outbox-aggregate-type") == "order"
    assert header(order, "outbox-aggregate-id") == "42"
    uuid.UUID(header(order, "outbox-event-id") or "")
    assert by_value[b"\x00\x01\xff"].key is None
    tombstone = by_value[None]
    assert tombstone.key == b"order-42"
    # Same key, same partition, commit order.
    assert tombstone.partition == order.partition
    assert tombstone.offset > order.offset


async def test_rolled_back_events_are_never_published(
    db_dsn: str, services: Services, topic: str
) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        async with Relay(make_settings(db_dsn, services)):
            for i in range(5):
                tx = conn.transaction()
                await tx.start()
                await enqueue(conn, topic=topic, key="k", payload={"rolled_back": i})
                await tx.rollback()
            marker = await enqueue(conn, topic=topic, key="k", payload={"marker": True})
            records, _ = await consume(services.bootstrap, topic, expect=1, within=30)
        # A graceful stop leaves no published row unmarked: the table is empty, and the
        # topic holds exactly the one committed event.
        assert await conn.fetchval("SELECT count(*) FROM outbox") == 0
        _, total = await consume(services.bootstrap, topic, expect=1, within=30)
    finally:
        await conn.close()
    assert total == 1
    assert header(records[0], "outbox-event-id") == str(marker)


async def test_fallback_poll_delivers_when_the_trigger_is_disabled(
    db_dsn: str, services: Services, topic: str
) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute("ALTER TABLE outbox DISABLE TRIGGER outbox_notify")
        settings = make_settings(db_dsn, services, poll_interval=0.3)
        async with Relay(settings) as relay:
            # The start wake-up sends every worker to look once: only after that look may
            # the row be committed, or the start's claim (not the poll) could find it.
            with anyio.fail_after(10):
                await relay.events.wait_for("idle", at_least=settings.workers)
            await enqueue(conn, topic=topic, key="k", payload={"n": 1})
            await consume(services.bootstrap, topic, expect=1, within=30)
        assert relay.events.counts["wake:notification"] == 0
        assert relay.events.counts["wake:poll"] >= 1
    finally:
        await conn.close()


async def test_poison_rows_are_dead_lettered_while_other_keys_flow(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Policy: a failing row holds back later rows of its key while it is retried; once it is
    dead-lettered, they go on. Other keys never wait."""
    settings = make_settings(
        db_dsn,
        services,
        max_attempts=3,
        retry_base_delay=0.05,
        retry_max_delay=0.1,
        poll_interval=0.2,  # retries become due between notifications
        kafka_max_request_size=10_000,
    )
    # Every committed claim in commit order: (row ids published, retried, dead-lettered).
    batches: list[tuple[set[int], set[int], set[int]]] = []
    conn = await asyncpg.connect(db_dsn)
    try:
        async with Relay(settings) as relay:
            relay.events.add_batch_observer(
                lambda _rows, outcome, _unavailable: batches.append(
                    (
                        set(outcome.published),
                        {i for i, _, _ in outcome.retry},
                        {i for i, _ in outcome.dead},
                    )
                )
            )
            insert = "INSERT INTO outbox (topic, key, payload, headers) VALUES ($1, $2, $3, $4)"
            async with conn.transaction():  # one commit: the first claim sees every row
                ids = {
                    name: await conn.fetchval(f"{insert} RETURNING id", *values)
                    for name, values in {
                        "p1": ("no-such-topic", "p1", "{}", None),
                        "after": (topic, "p1", '{"after": 1}', None),
                        "p2": (topic, "p2", json.dumps({"big": "x" * 20000}), None),
                        "p3": (topic, "p3", "{}", '{"n": 1}'),
                        "ok": (topic, "ok", '{"fine": 1}', None),
                    }.items()
                }
            await relay.events.wait_for("dead_lettered", 3)
            records, _ = await consume(services.bootstrap, topic, expect=2, within=30)
        total = await topic_total(services.bootstrap, topic)  # the relay stopped
        dead = {
            r["key"]: r
            for r in await conn.fetch("SELECT key, error, attempts FROM outbox_dead_letter")
        }
        pending = await conn.fetchval("SELECT count(*) FROM outbox")
    finally:
        await conn.close()
    assert set(dead) == {"p1", "p2", "p3"}
    assert "does not exist" in dead["p1"]["error"]
    assert dead["p1"]["attempts"] == 3
    assert "MessageSizeTooLarge" in dead["p2"]["error"]
    assert dead["p2"]["attempts"] == 3
    assert "must have a string value" in dead["p3"]["error"]
    assert dead["p3"]["attempts"] == 1  # malformed: dead-lettered at once
    assert sorted(r.value or b"" for r in records) == [b'{"after": 1}', b'{"fine": 1}']
    assert total == 2
    assert pending == 0
    # The timeline of the claims: p1 failed, was retried, then dead-lettered...
    (p1_dead,) = [n for n, (_, _, d) in enumerate(batches) if ids["p1"] in d]
    p1_retries = [n for n, (_, r, _) in enumerate(batches) if ids["p1"] in r]
    assert len(p1_retries) == 2, batches
    assert max(p1_retries) < p1_dead, batches
    # ...while another key flowed: "ok" was published before p1's last attempt...
    (ok_sent,) = [n for n, (p, _, _) in enumerate(batches) if ids["ok"] in p]
    assert ok_sent < p1_dead, (ok_sent, p1_dead, batches)
    # ...and p1's later row was held back: nothing was decided for it (it stayed pending, as it
    # was) until p1 was dead-lettered, and it was published once, after that.
    decided = [n for n, batch in enumerate(batches) if any(ids["after"] in s for s in batch)]
    assert decided == [n for n, (p, _, _) in enumerate(batches) if ids["after"] in p], batches
    (after_sent,) = decided
    assert after_sent > p1_dead, (after_sent, p1_dead, batches)


async def test_listener_reconnects_after_its_backend_is_terminated(
    db_dsn: str, services: Services, topic: str
) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        async with Relay(make_settings(db_dsn, services, reconnect_min_delay=0.05)) as relay:
            killed = await conn.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'notify-outbox-listener' AND datname = current_database()"
            )
            assert killed == 1
            with anyio.fail_after(30):
                await relay.events.wait_for("listening", 2)
            await enqueue(conn, topic=topic, key="k", payload={"after": "reconnect"})
            await consume(services.bootstrap, topic, expect=1, within=30)
        assert relay.events.counts["listener_lost"] == 1
        assert relay.events.counts["wake:reconnect"] == 1
        assert relay.events.counts["wake:poll"] == 0
    finally:
        await conn.close()


async def test_listener_is_never_idle_in_transaction(db_dsn: str, services: Services) -> None:
    """Sampled until it has been seen idle 20 times (one snapshot can catch it running a
    statement, a health probe or a gate statement): never inside a transaction."""
    conn = await asyncpg.connect(db_dsn)
    seen: list[str | None] = []

    async def idle_often() -> bool:
        seen.append(
            await conn.fetchval(
                "SELECT state FROM pg_stat_activity "
                "WHERE application_name = 'notify-outbox-listener' AND datname = current_database()"
            )
        )
        assert seen[-1] in ("idle", "active"), f"listener state {seen[-1]!r}"
        return seen.count("idle") >= 20

    try:
        async with Relay(make_settings(db_dsn, services)):
            await eventually(idle_often, within=60, what="the listener was seen idle 20 times")
    finally:
        await conn.close()


async def test_keep_published_marks_rows_then_cleans_them_up(
    db_dsn: str, services: Services, topic: str
) -> None:
    settings = make_settings(db_dsn, services, keep_published=0.2, cleanup_interval=0.1)
    conn = await asyncpg.connect(db_dsn)
    try:
        async with Relay(settings) as relay:
            await enqueue(conn, topic=topic, key="k", payload={"n": 1})
            with anyio.fail_after(30):
                await relay.events.wait_for("published")
            published_at = await conn.fetchval("SELECT published_at FROM outbox")
            assert published_at is not None
            with anyio.fail_after(30):
                await relay.events.wait_for("cleanup")
            assert await conn.fetchval("SELECT count(*) FROM outbox") == 0
    finally:
        await conn.close()


async def test_embedded_relay_runs_in_the_host_loop_and_stops_on_cancellation(
    db_dsn: str, services: Services, topic: str
) -> None:
    relay = Relay(make_settings(db_dsn, services))
    task = asyncio.create_task(relay.run())
    conn = await asyncpg.connect(db_dsn)
    try:
        with anyio.fail_after(30):
            await relay.wait_ready()
        await enqueue(conn, topic=topic, key="k", payload={"n": 1})
        await consume(services.bootstrap, topic, expect=1, within=30)
        task.cancel()
        with anyio.fail_after(10), pytest.raises(asyncio.CancelledError):
            await task
        # Its connections are closed at once on its side...
        assert relay.listener is not None
        assert relay.listener.connection is None
        # ...and the server ends their sessions shortly after (asynchronously: bounded wait).

        async def sessions_gone() -> bool:
            left = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE application_name LIKE 'notify-outbox%' AND datname = current_database()"
            )
            return not left

        await eventually(sessions_gone, within=5, interval=0.02, what="the relay's sessions ended")
    finally:
        await conn.close()


async def test_relay_refuses_to_start_without_the_outbox_table(
    empty_db_dsn: str, services: Services
) -> None:
    from notify_outbox import MigrationError

    with pytest.raises(MigrationError, match="notify-outbox migrate"):
        async with Relay(make_settings(empty_db_dsn, services)):
            pass


async def test_topic_created_after_the_first_failure_is_used_on_retry(
    db_dsn: str, services: Services
) -> None:
    late = f"late-{uuid.uuid4().hex[:8]}"
    settings = make_settings(
        db_dsn, services, retry_base_delay=0.05, retry_max_delay=0.1, poll_interval=0.2
    )
    conn = await asyncpg.connect(db_dsn)
    try:
        async with Relay(settings) as relay:
            await enqueue(conn, topic=late, key="k", payload={"n": 1})
            with anyio.fail_after(30):
                await relay.events.wait_for("retried")
            await create_topics(services.bootstrap, [late], partitions=1)
            await consume(services.bootstrap, late, expect=1, within=30)
        assert await conn.fetchval("SELECT count(*) FROM outbox_dead_letter") == 0
    finally:
        await conn.close()


async def test_claims_read_committed_whatever_the_database_default(
    db_dsn: str, services: Services, topic: str
) -> None:
    """A claim needs a new snapshot per statement (migrations 0005 and 0006), so it pins READ
    COMMITTED. With SERIALIZABLE as the database's default, four workers drain a keyed
    backlog without a single database error (under one snapshot, a claim would meet rows a
    sibling published meanwhile and fail to serialize), each key in commit order."""
    conn = await asyncpg.connect(db_dsn)
    try:
        database = await conn.fetchval("SELECT current_database()")
        await conn.execute(
            f"ALTER DATABASE \"{database}\" SET default_transaction_isolation = 'serializable'"
        )
        await conn.execute(
            "INSERT INTO outbox (topic, key, payload) "
            "SELECT $1, 'k' || (g % 50), jsonb_build_object('n', g) "
            "FROM generate_series(1, 3000) g",
            topic,
        )
        settings = make_settings(db_dsn, services, workers=4, batch_size=50)
        async with Relay(settings) as relay:
            isolation = await relay_isolation(db_dsn)
            records, _ = await consume(services.bootstrap, topic, expect=3000, within=60)
        total = await topic_total(services.bootstrap, topic)  # the relay stopped
    finally:
        await conn.close()
    assert isolation == "serializable"  # the relay's sessions did get the default
    assert total == 3000
    assert relay.events.counts["db_error"] == 0
    by_key: dict[bytes | None, list[int]] = {}
    for record in records:  # per partition in offset order: a key's order
        assert record.value is not None
        by_key.setdefault(record.key, []).append(json.loads(record.value)["n"])
    assert all(ns == sorted(ns) for ns in by_key.values())


async def relay_isolation(dsn: str) -> str:
    """The default isolation of a new session of this database (what the relay's get)."""
    conn = await asyncpg.connect(dsn)
    try:
        return str(await conn.fetchval("SHOW default_transaction_isolation"))
    finally:
        await conn.close()


async def test_a_record_over_the_topics_limit_fails_its_row_and_nothing_else(
    db_dsn: str, services: Services
) -> None:
    """A row over its topic's max.message.bytes (within the producer's max_request_size, so
    only the broker refuses it) is retried and dead-lettered with the broker's reason, while
    the same topic's other keys and another topic flow; the producer is not replaced and
    sending is never paused (issue #33: such a record took the path of a broken producer,
    pausing every topic at each attempt)."""
    small, other = f"small-{uuid.uuid4().hex[:8]}", f"ok-{uuid.uuid4().hex[:8]}"
    await create_topics(
        services.bootstrap, [small], partitions=1, configs={"max.message.bytes": "2000"}
    )
    await create_topics(services.bootstrap, [other], partitions=1)
    settings = make_settings(
        db_dsn,
        services,
        max_attempts=3,
        retry_base_delay=0.05,
        retry_max_delay=0.1,
        poll_interval=0.2,
    )
    insert = "INSERT INTO outbox (topic, key, payload) VALUES ($1, $2, $3::jsonb)"
    big = json.dumps({"pad": "x" * 5_000})
    conn = await asyncpg.connect(db_dsn)
    try:
        with (
            logged("notify_outbox.publisher", "replacing the producer") as replaced,
            logged("notify_outbox.relay", "Kafka unavailable") as paused,
            anyio.fail_after(90),
        ):
            async with Relay(settings) as relay:
                await conn.execute(insert, small, "warm", "{}")
                await consume(services.bootstrap, small, expect=1)
                for n in range(3):
                    # Each big row between small rows of other keys on its partition, so the
                    # batches behind its refused one are dropped and sent again.
                    async with conn.transaction():
                        await conn.execute(insert, small, f"big{n}", big)
                        for m in range(5):
                            await conn.execute(insert, small, f"s{n}-{m}", "{}")
                for n in range(10):
                    await conn.execute(insert, other, f"a{n}", "{}")
                records, _ = await consume(services.bootstrap, other, expect=10)
                smalls, _ = await consume(services.bootstrap, small, expect=16)
                await relay.events.wait_for("dead_lettered", 3)
            dead = await conn.fetch("SELECT key, error FROM outbox_dead_letter ORDER BY key")
    finally:
        await conn.close()
    assert len(records) == 10
    assert sorted(r.key.decode() for r in smalls if r.key is not None) == sorted(
        ["warm"] + [f"s{n}-{m}" for n in range(3) for m in range(5)]
    )
    assert [d["key"] for d in dead] == ["big0", "big1", "big2"]
    assert all("MessageSizeTooLarge" in d["error"] for d in dead), dead
    assert not replaced.is_set()
    assert not paused.is_set()


async def test_a_topic_deleted_under_the_relay_fails_its_rows_and_nothing_else(
    db_dsn: str, services: Services
) -> None:
    """Rows for a topic deleted while the relay runs (its metadata still cached) are retried
    and dead-lettered as missing; the producer is not replaced, sending is never paused, and
    another topic's rows flow meanwhile (issue #33: one such topic slowed every topic)."""
    gone, other = f"gone-{uuid.uuid4().hex[:8]}", f"ok-{uuid.uuid4().hex[:8]}"
    await create_topics(services.bootstrap, [gone, other])
    admin = AIOKafkaAdminClient(bootstrap_servers=services.bootstrap)
    await admin.start()
    settings = make_settings(
        db_dsn,
        services,
        max_attempts=3,
        retry_base_delay=0.05,
        retry_max_delay=0.1,
        poll_interval=0.2,
    )
    conn = await asyncpg.connect(db_dsn)
    try:
        with (
            logged("notify_outbox.publisher", "replacing the producer") as replaced,
            logged("notify_outbox.relay", "Kafka unavailable") as paused,
            anyio.fail_after(90),
        ):
            async with Relay(settings) as relay:
                insert = "INSERT INTO outbox (topic, key, payload) VALUES ($1, $2, '{}')"
                await conn.execute(insert, gone, "warm")
                await consume(services.bootstrap, gone, expect=1)  # the relay knows the topic
                await admin.delete_topics([gone])
                for n in range(3):
                    await conn.execute(insert, gone, f"d{n}")
                for n in range(10):
                    await conn.execute(insert, other, f"a{n}")
                records, _ = await consume(services.bootstrap, other, expect=10)
                await relay.events.wait_for("dead_lettered", 3)
            dead = await conn.fetch("SELECT key, error FROM outbox_dead_letter ORDER BY key")
    finally:
        await conn.close()
        await admin.close()
    assert len(records) == 10
    assert [d["key"] for d in dead] == ["d0", "d1", "d2"]
    assert all(f"topic '{gone}' does not exist in Kafka" in d["error"] for d in dead)
    assert not replaced.is_set()
    assert not paused.is_set()
