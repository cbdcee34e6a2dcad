"""The checker itself: it must see each kind of violation when one is staged on purpose.

A checker that always says OK would make the whole suite worthless, so this stages one lost
event, one phantom, one duplicate and one same-key pair committed out of id order, and
requires the report to count exactly those; and a key whose rows on two topics were sent in
the wrong order; and, read_committed, a transaction left open in front of committed records.
"""

from __future__ import annotations

import uuid

import pytest
from aiokafka import AIOKafkaProducer

from tests.conftest import Services
from tests.faults.checker import INSERT_RETURNING, RECORD_AND_STAMP, Attempt, OutboxChecker
from tests.faults.harness import FaultRelay, connect, relays
from tests.support import create_topics

pytestmark = pytest.mark.anyio


async def test_the_checker_counts_staged_violations(
    db_dsn: str, services: Services, topic: str
) -> None:
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "checker control").setup()
    async with connect(db_dsn) as admin:
        # Without the per-key ordering trigger, ids no longer follow commit order per key.
        await admin.execute("ALTER TABLE outbox DISABLE TRIGGER outbox_order_key")
    async with checker.producer() as first, checker.producer() as second:
        for i in range(20):
            await first.produce(f"key-{i % 4}")
        # Out of order: the lower id commits second (its counter bump, the commit order as
        # the checker sees it, comes after the other transaction's).
        assert first.conn is not None
        early = str(uuid.uuid4())
        checker.ledger.attempts[early] = Attempt(topic, "key-x", "committed")
        async with first.conn.transaction():
            row_id = await first.conn.fetchval(INSERT_RETURNING, early, topic, "key-x")
            await second.produce("key-x")
            await first.conn.fetchval(RECORD_AND_STAMP, early, topic, "key-x", row_id)
        # Lost: committed, then removed behind the relay's back.
        lost = await first.produce("key-lost")
        async with connect(db_dsn) as admin:
            await admin.execute("DELETE FROM outbox WHERE event_id = $1", uuid.UUID(lost))
            # Phantom: a row that no producer recorded as committed.
            await admin.execute(
                "INSERT INTO outbox (topic, key, payload) VALUES ($1, 'key-phantom', '{}')", topic
            )
    async with relays(FaultRelay(db_dsn, services.bootstrap)) as (relay,):
        await relay.ready()
        report = await checker.drain_and_check(within=60, record=False)
        await relay.stop_ok()
    # Duplicate: the same event id once more.
    copy = next(r for r in report.records if r.key == "key-0")
    producer = AIOKafkaProducer(bootstrap_servers=services.bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(
            topic,
            b"{}",
            key=b"key-0",
            headers=[("outbox-event-id", (copy.event_id or "").encode())],
        )
    finally:
        await producer.stop()
    report = await checker.drain_and_check(within=60, record=False)
    print(report.text())
    assert report.lost == [lost]
    assert len(report.phantom) == 1
    assert report.duplicates == 1
    assert list(report.out_of_order) == [f"{topic}/key-x"]
    assert report.inversions == 1
    assert not report.ok
    assert "FAILED" in report.text()


async def test_the_checker_sees_a_key_out_of_order_across_topics(
    db_dsn: str, services: Services, topic: str
) -> None:
    """A key's rows on two topics: the later row sent (by its record's CreateTime) before the
    earlier one was. Offsets cannot show it (two partitions); the checker must. Another key,
    sent in order, and a tie within one millisecond, must pass."""
    other = f"t-{uuid.uuid4().hex[:12]}"
    await create_topics(services.bootstrap, [other], partitions=3)
    checker = await OutboxChecker(
        db_dsn, services.bootstrap, [topic, other], "checker control, across topics"
    ).setup()
    async with checker.producer() as p:
        sent: list[tuple[str, str, str, int]] = []  # (topic, key, event id, CreateTime)
        base = 1_700_000_000_000
        for key, (first_at, second_at) in {
            "key-inverted": (base + 1000, base),
            "key-in-order": (base, base + 1000),
            "key-tie": (base, base),
        }.items():
            sent.append((topic, key, await p.produce(key, topic=topic), first_at))
            sent.append((other, key, await p.produce(key, topic=other), second_at))
    async with connect(db_dsn) as admin:
        await admin.execute("UPDATE outbox SET published_at = now()")  # no relay: sent below
    producer = AIOKafkaProducer(bootstrap_servers=services.bootstrap)
    await producer.start()
    try:
        for to, key, event_id, at in sent:
            await producer.send_and_wait(
                to,
                b"{}",
                key=key.encode(),
                timestamp_ms=at,
                headers=[("outbox-event-id", event_id.encode())],
            )
    finally:
        await producer.stop()
    report = await checker.drain_and_check(within=60, record=False)
    print(report.text())
    assert report.lost == []
    assert report.phantom == []
    assert report.duplicates == 0
    assert report.keys_across_topics == 3
    assert list(report.out_of_order) == ["*/key-inverted"]
    assert report.inversions == 1
    assert not report.ok


async def test_a_read_committed_check_waits_for_open_transactions_and_names_them(
    db_dsn: str, services: Services, topic: str
) -> None:
    """A read_committed consumer stops at the last stable offset: below a transaction still
    open, or one committed whose markers the coordinator has not written yet (it answers the
    commit first). A check that read only up to there would call every event behind it lost.
    Staged: event A's record in a transaction left open, then event B's record outside any
    transaction. While A's transaction is open the check fails as not drained, names where
    it stopped, and finds both events written but not committed; once it commits, the same
    check passes with both."""
    checker = await OutboxChecker(
        db_dsn,
        services.bootstrap,
        [topic],
        "checker control, read_committed",
        isolation_level="read_committed",
    ).setup()
    async with checker.producer() as p:
        a = await p.produce("key-a")
        b = await p.produce("key-b")
    async with connect(db_dsn) as admin:
        await admin.execute("UPDATE outbox SET published_at = now()")  # no relay: sent below
    transactional = AIOKafkaProducer(
        bootstrap_servers=services.bootstrap, transactional_id=f"checker-{uuid.uuid4().hex}"
    )
    plain = AIOKafkaProducer(bootstrap_servers=services.bootstrap)
    await transactional.start()
    await plain.start()
    try:
        await transactional.begin_transaction()
        for event_id, key in ((a, b"key-a"), (b, b"key-b")):
            sender = transactional if event_id == a else plain
            await sender.send_and_wait(
                topic, b"{}", key=key, partition=0, headers=[("outbox-event-id", event_id.encode())]
            )
        report = await checker.drain_and_check(within=3, record=False)
        print(report.text())
        assert not report.drained
        assert len(report.stuck) == 1
        assert report.stuck[0].startswith(f"{topic}[0]")
        assert sorted(report.lost) == sorted([a, b])
        assert report.lost_in_log.startswith("2 of 2 written")
        assert not report.ok
        await transactional.commit_transaction()
    finally:
        await transactional.stop()
        await plain.stop()
    report = await checker.drain_and_check(within=30, record=False)
    print(report.text())
    assert report.drained
    assert report.lost == []
    report.assert_ok()
