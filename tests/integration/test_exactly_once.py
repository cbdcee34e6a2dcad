"""Exactly-once delivery in-process, against real PostgreSQL and Kafka: each event once to a
read_committed consumer, in per-key order; failing rows; the delivery mode guard; a clean
stop. The crashes are in tests/faults/test_exactly_once.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import Counter, defaultdict
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer

from notify_outbox import OutboxSettings, Relay
from notify_outbox.core.errors import ConfigurationError
from notify_outbox.inbox import Inbox, consume_batches, migrate_inbox
from notify_outbox.relay.exactly_once import ExactlyOnceRelay
from tests.conftest import Services
from tests.faults.harness import create_topic_with_configs, eventually
from tests.support import consume, header

pytestmark = pytest.mark.anyio

READ_COMMITTED = {"isolation_level": "read_committed"}


def eos_settings(db_dsn: str, services: Services, **kw: Any) -> OutboxSettings:
    tag = uuid.uuid4().hex[:8]
    base: dict[str, Any] = {
        "dsn": db_dsn,
        "kafka_bootstrap_servers": services.bootstrap,
        "delivery": "exactly-once",
        "workers": 2,
        "eos_slots": 4,
        "batch_size": 50,
        "poll_interval": 30.0,  # long: these tests must not pass thanks to the poll
        "keep_published": 3600,
        "eos_marker_topic": f"eos-markers-{tag}",
        "eos_transactional_id_prefix": f"test-{tag}.",
        "reconnect_min_delay": 0.05,
        "reconnect_max_delay": 1.0,
    }
    base.update(kw)
    return OutboxSettings(**base)


async def _set_delivery(dsn: str, mode: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("UPDATE outbox_config SET delivery = $1", mode)
    finally:
        await conn.close()


async def _insert(
    dsn: str, topic: str, keys: list[str | None], *, headers: str | None = None
) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            for i, key in enumerate(keys):
                await conn.execute(
                    "INSERT INTO outbox (topic, key, payload, headers) VALUES ($1, $2, $3, $4)",
                    topic,
                    key,
                    f'{{"n": {i}}}',
                    headers,
                )
    finally:
        await conn.close()


async def stamp_and_vanish(conn: asyncpg.Connection, slot: int) -> list[asyncpg.Record]:
    """A step as a relay would take it on ``slot``, by an owner whose lease has already
    expired (it vanished with the batch stamped); the rows it stamped."""
    await conn.execute(
        "INSERT INTO outbox_eos_slot (slot, owner, expires_at) VALUES ($1, 'gone', now())", slot
    )
    return list(
        await conn.fetch(
            "SELECT * FROM outbox_eos_step($1, 'gone', 1000, NULL, NULL, '{}', '{}', '{}', "
            "'{}', '{}', false, 10, 100)",
            slot,
        )
    )


async def _fetchval(dsn: str, sql: str) -> Any:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


async def test_each_event_once_in_key_order_to_a_read_committed_consumer(
    db_dsn: str, services: Services, topic: str
) -> None:
    await _set_delivery(db_dsn, "exactly-once")
    settings = eos_settings(db_dsn, services)
    keys = [f"k{i % 10}" for i in range(100)]
    async with ExactlyOnceRelay(settings) as relay:
        for t in range(6):  # six producer transactions while the relay runs
            await _insert(db_dsn, topic, [*keys[t * 10 :], *keys[: t * 10]][:50])
        records, _ = await consume(
            services.bootstrap, topic, expect=300, within=60, client=READ_COMMITTED
        )
    assert relay.outcome == "stopped"
    # Read again once the relay stopped: nothing can come after.
    later, _ = await consume(services.bootstrap, topic, expect=300, client=READ_COMMITTED)
    assert len(later) == 300
    ids = [header(r, "outbox-event-id") for r in later]
    assert len(set(ids)) == 300, Counter(ids).most_common(3)
    # Per-key order: the payload's position in each transaction, transactions in order.
    db_order = {
        str(r["event_id"]): r["id"] for r in await _fetch(db_dsn, "SELECT id, event_id FROM outbox")
    }
    by_key: dict[bytes | None, list[int]] = defaultdict(list)
    for r in sorted(later, key=lambda r: (r.partition, r.offset)):
        by_key[r.key].append(db_order[header(r, "outbox-event-id") or ""])
    for key, row_ids in by_key.items():
        assert row_ids == sorted(row_ids), f"key {key!r} out of order"
    assert await _fetchval(db_dsn, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
    assert await _fetchval(db_dsn, "SELECT count(*) FROM outbox_eos_stamp") == 0
    held = "SELECT count(*) FROM outbox_eos_slot WHERE owner IS NOT NULL"
    assert await _fetchval(db_dsn, held) == 0, "a stopped relay lets its slots go"
    assert relay.counters["committed"] >= 1
    assert relay.events.counts["wake:notification"] >= 1
    assert len(records) == 300


async def _fetch(dsn: str, sql: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql))
    finally:
        await conn.close()


async def test_a_malformed_row_is_dead_lettered_and_a_missing_topic_retried_while_others_flow(
    db_dsn: str, services: Services, topic: str
) -> None:
    await _set_delivery(db_dsn, "exactly-once")
    settings = eos_settings(db_dsn, services, retry_base_delay=30.0)
    async with ExactlyOnceRelay(settings):
        await _insert(db_dsn, topic, ["bad"], headers='{"n": 1}')  # a header must be a string
        await _insert(db_dsn, topic, ["bad", "good"])
        await _insert(db_dsn, f"missing-{uuid.uuid4().hex[:8]}", ["lost"])
        await _insert(db_dsn, topic, ["lost", "good"])
        records, _ = await consume(
            services.bootstrap, topic, expect=3, within=60, client=READ_COMMITTED
        )
        # The bad row is dead-lettered at once and its key's next row follows; the row of the
        # missing topic waits for its retry, holding its key's next row back.
        await eventually(
            lambda: _is(db_dsn, "SELECT count(*) FROM outbox_dead_letter", 1),
            within=30,
            what="the malformed row dead-lettered",
        )
        await eventually(
            lambda: _is(
                db_dsn,
                "SELECT count(*) FROM outbox WHERE key = 'lost' AND attempts = 1 "
                "AND next_attempt_at IS NOT NULL",
                1,
            ),
            within=30,
            what="the missing topic's row waiting for a retry",
        )
        assert sorted(r.key for r in records) == [b"bad", b"good", b"good"]
        held = await _fetchval(
            db_dsn,
            f"SELECT published_at IS NULL FROM outbox WHERE key = 'lost' AND topic = '{topic}'",
        )
        assert held, "the key's later row must wait behind the failed one"
    dead = await _fetchval(db_dsn, "SELECT error FROM outbox_dead_letter")
    assert "header 'n' must have a string value" in dead


async def _is(dsn: str, sql: str, expected: int) -> bool:
    return bool(await _fetchval(dsn, sql) == expected)


async def test_relays_of_the_other_mode_refuse_to_start(
    db_dsn: str, services: Services, topic: str
) -> None:
    # The outbox is at-least-once (the default): an exactly-once relay refuses.
    with pytest.raises(ConfigurationError, match="set to at-least-once delivery"):
        async with ExactlyOnceRelay(eos_settings(db_dsn, services)):
            pass
    await _set_delivery(db_dsn, "exactly-once")
    at_least_once = OutboxSettings(
        dsn=db_dsn, kafka_bootstrap_servers=services.bootstrap, poll_interval=30.0
    )
    with pytest.raises(ConfigurationError, match="set to exactly-once delivery"):
        async with Relay(at_least_once):
            pass


async def test_a_slot_held_by_a_vanished_relay_is_settled_and_its_keys_go_on(
    db_dsn: str, services: Services, topic: str
) -> None:
    """A relay that stamped a batch and vanished before sending it (its lease expires): the
    rescuer fences the slot's producer, finds no committed marker, gives the rows back, and
    they are sent once."""
    await _set_delivery(db_dsn, "exactly-once")
    # Published rows deleted (keep_published 0, the default): retention has nothing to do.
    settings = eos_settings(db_dsn, services, eos_lease=1.0, keep_published=0)
    await _insert(db_dsn, topic, ["a", "a", "b"])
    conn = await asyncpg.connect(db_dsn)
    try:
        stamped = await stamp_and_vanish(conn, 2)
        assert len(stamped) == 3
    finally:
        await conn.close()
    await _insert(db_dsn, topic, ["a", "c"])
    conn = await asyncpg.connect(db_dsn)
    try:
        # While the stamps stand, another slot takes nothing of their keys: only c.
        await conn.execute("INSERT INTO outbox_eos_slot (slot, owner) VALUES (3, 'probe')")
        probe = await conn.fetch(
            "SELECT * FROM outbox_eos_step(3, 'probe', 1000, NULL, NULL, '{}', '{}', '{}', "
            "'{}', '{}', false, 10, 100)"
        )
        assert [r["key"] for r in probe] == ["c"]
        # Given back (an aborted batch with no failure), c is fresh again.
        await conn.fetch(
            "SELECT * FROM outbox_eos_step(3, 'probe', 1000, $1, false, '{}', '{}', '{}', "
            "'{}', '{}', false, 0, 100)",
            probe[0]["seq"],
        )
        await conn.execute("DELETE FROM outbox_eos_slot WHERE slot = 3")
    finally:
        await conn.close()
    async with ExactlyOnceRelay(settings) as relay:
        await consume(services.bootstrap, topic, expect=5, within=60, client=READ_COMMITTED)
    records, _ = await consume(services.bootstrap, topic, expect=5, client=READ_COMMITTED)
    assert len(records) == 5
    a = [json.loads(r.value or b"") for r in records if r.key == b"a"]
    assert a == [{"n": 0}, {"n": 1}, {"n": 0}], "key a in commit order"
    assert relay.counters["recovered_aborted"] == 1


async def test_a_record_the_broker_refuses_aborts_its_transaction_and_nothing_repeats(
    db_dsn: str, services: Services
) -> None:
    """A record over its topic's max.message.bytes, refused by the broker inside a batch's
    transaction. aiokafka would commit the rest of such a transaction (measured in
    docs/concepts/exactly-once-client.md), and the retry would then send the rest again: the
    relay waits for every ack and aborts instead. The row is retried, then dead-lettered; its
    key's next row and the other keys' rows are seen exactly once."""
    topic = f"small-{uuid.uuid4().hex[:8]}"
    await create_topic_with_configs(
        services.bootstrap, topic, {"max.message.bytes": "2000"}, partitions=1
    )
    await _set_delivery(db_dsn, "exactly-once")
    settings = eos_settings(db_dsn, services, max_attempts=2, retry_base_delay=0.2)
    conn = await asyncpg.connect(db_dsn)
    try:
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO outbox (topic, key, payload) VALUES ($1, 'a', $2), "
                "($1, 'b', '{\"n\": 1}'), ($1, 'a', '{\"n\": 2}'), ($1, 'c', '{\"n\": 3}')",
                topic,
                json.dumps({"blob": "x" * 5000}),
            )
    finally:
        await conn.close()
    async with ExactlyOnceRelay(settings) as relay:
        await eventually(
            lambda: _is(db_dsn, "SELECT count(*) FROM outbox_dead_letter", 1),
            within=30,
            what="the refused row dead-lettered after its retry",
        )
        await consume(services.bootstrap, topic, expect=3, within=30, client=READ_COMMITTED)
    records, _ = await consume(services.bootstrap, topic, expect=3, client=READ_COMMITTED)
    assert sorted(json.loads(r.value or b"")["n"] for r in records) == [1, 2, 3]
    assert relay.counters["aborted"] >= 2  # the first attempt and the retry
    dead = await _fetchval(db_dsn, "SELECT error FROM outbox_dead_letter")
    assert "MessageSizeTooLarge" in dead or "RecordTooLarge" in dead, dead


async def test_the_inbox_applies_the_exactly_once_output_read_committed(
    db_dsn: str, services: Services, topic: str
) -> None:
    """A consumer written with this library reads the mode's topics with
    ``isolation_level="read_committed"`` on its own AIOKafkaConsumer: ``consume_batches``
    applies every event once."""
    await _set_delivery(db_dsn, "exactly-once")
    conn = await asyncpg.connect(db_dsn)
    try:
        await migrate_inbox(conn)
        await conn.execute("CREATE TABLE applied (event_id text NOT NULL)")
    finally:
        await conn.close()

    async def handler(conn: asyncpg.Connection, messages: list[Any]) -> None:
        ids = [header(m, "outbox-event-id") for m in messages]
        await conn.execute("INSERT INTO applied SELECT unnest($1::text[])", ids)

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=services.bootstrap,
        group_id=f"g-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=2)
    await consumer.start()
    try:
        async with ExactlyOnceRelay(eos_settings(db_dsn, services)):
            await _insert(db_dsn, topic, [f"k{i % 5}" for i in range(40)])
            loop = asyncio.create_task(
                consume_batches(consumer, pool, handler, inbox=Inbox(consumer="eos"))
            )
            try:
                await eventually(
                    lambda: _is(db_dsn, "SELECT count(*) FROM applied", 40),
                    within=30,
                    what="the inbox applied the 40 events",
                )
            finally:
                loop.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop
    finally:
        await consumer.stop()
        await pool.close()
    assert await _fetchval(db_dsn, "SELECT count(DISTINCT event_id) FROM applied") == 40
