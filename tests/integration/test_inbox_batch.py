"""The inbox's batch path against a real PostgreSQL (and Kafka for the loops): one transaction
and one claim statement per batch, handler failures located and handled by policy, repeats,
open transactions refused, isolation races retried, and the rebalance listener."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition

from notify_outbox.core.errors import ConfigurationError
from notify_outbox.inbox import (
    BadEventId,
    HandlerFailed,
    Inbox,
    InboxRebalanceListener,
    InTransaction,
    consume,
    consume_batches,
    migrate_inbox,
)
from tests.conftest import Services
from tests.integration.test_inbox import connect
from tests.support import create_topics

pytestmark = pytest.mark.anyio


@dataclass
class Msg:
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    key: bytes | None = None
    value: bytes | None = None
    topic: str = "orders"
    partition: int = 0
    offset: int = 0


def batch_of(n: int, ids: Sequence[str] | None = None) -> list[Msg]:
    ids = list(ids or [str(uuid.uuid4()) for _ in range(n)])
    return [
        Msg([("outbox-event-id", e.encode())], value=f"v{i}".encode(), offset=i)
        for i, e in enumerate(ids)
    ]


def eid(m: Msg) -> str:
    return m.headers[0][1].decode()


@pytest.fixture
async def pool(empty_db_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    async with connect(empty_db_dsn) as conn:
        await migrate_inbox(conn)
        await conn.execute("CREATE TABLE applied (event_id text NOT NULL)")
    p = await asyncpg.create_pool(empty_db_dsn, min_size=1, max_size=3)
    yield p
    await p.close()


async def bulk(conn: asyncpg.Connection, messages: list[Any]) -> None:
    """The handler a batch path is for: every fresh message in one statement."""
    await conn.execute("INSERT INTO applied SELECT unnest($1::text[])", [eid(m) for m in messages])


async def one(conn: asyncpg.Connection, message: Any) -> None:
    await conn.execute("INSERT INTO applied VALUES ($1)", eid(message))


async def applied(db: asyncpg.Pool) -> dict[str, int]:
    rows = await db.fetch("SELECT event_id, count(*) AS n FROM applied GROUP BY event_id")
    return {r["event_id"]: r["n"] for r in rows}


# --- one batch --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["batch", "each"])
async def test_a_batch_applies_only_fresh_messages_once(pool: asyncpg.Pool, path: str) -> None:
    inbox = Inbox(consumer="c")
    first = batch_of(6)
    # The same batch again, plus an id twice inside one batch (a relay's duplicate) and one new.
    new = batch_of(1)
    again = [*first, new[0], first[2], new[0]]
    seen: list[list[str]] = []

    async def handler(conn: asyncpg.Connection, messages: list[Any]) -> None:
        seen.append([eid(m) for m in messages])
        await bulk(conn, messages)

    async def each(conn: asyncpg.Connection, message: Any) -> None:
        seen.append([eid(message)])
        await one(conn, message)

    async def run(messages: list[Msg]) -> Any:
        if path == "batch":
            return await inbox.apply_batch(pool, messages, handler)
        return await inbox.apply_each(pool, messages, each)

    r1 = await run(first)
    assert (r1.done, r1.applied, r1.duplicates) == (6, 6, 0)
    r2 = await run(again)
    assert (r2.done, r2.applied, r2.duplicates) == (9, 1, 8)
    assert await applied(pool) == dict.fromkeys([eid(m) for m in [*first, *new]], 1)
    flat = [e for call in seen for e in call]
    assert flat == [eid(m) for m in [*first, *new]]  # in order, each id once, no repeat
    assert len(seen) == (2 if path == "batch" else 7)
    assert inbox.counts["applied"] == 7
    assert inbox.counts["duplicate"] == 8


async def failing_on(bad: set[str], calls: list[int]) -> Any:
    async def handler(conn: asyncpg.Connection, messages: list[Any]) -> None:
        calls.append(len(messages))
        await bulk(conn, messages)  # written, then rolled back with the batch
        if bad & {eid(m) for m in messages}:
            raise RuntimeError("bad order")

    return handler


@pytest.mark.parametrize("path", ["batch", "each"])
async def test_a_failing_message_stops_the_batch_after_the_ones_before_it(
    pool: asyncpg.Pool, path: str
) -> None:
    inbox = Inbox()
    messages = batch_of(20)
    bad = eid(messages[13])
    calls: list[int] = []
    handler = await failing_on({bad}, calls)

    async def each(conn: asyncpg.Connection, message: Any) -> None:
        await handler(conn, [message])

    async def run() -> Any:
        if path == "batch":
            return await inbox.apply_batch(pool, messages, handler)
        return await inbox.apply_each(pool, messages, each)

    with pytest.raises(HandlerFailed, match="offset 13") as raised:
        await run()
    failed = raised.value
    assert isinstance(failed.__cause__, RuntimeError)
    assert failed.message is messages[13]
    assert failed.result is not None
    assert failed.result.done == 13
    assert failed.result.applied == 13
    assert await applied(pool) == dict.fromkeys([eid(m) for m in messages[:13]], 1)
    # Redelivered (the offset stayed before it) with the handler fixed: the rest, once each.
    fixed = await inbox.apply_batch(pool, messages, bulk)
    assert (fixed.applied, fixed.duplicates) == (7, 13)
    assert await applied(pool) == dict.fromkeys(map(eid, messages), 1)
    if path == "batch":
        # Halving: log2(20) levels, not one transaction per message.
        assert len(calls) <= 12, calls


@pytest.mark.parametrize("path", ["batch", "each"])
async def test_dead_letter_records_the_failing_message_and_goes_on(
    pool: asyncpg.Pool, path: str
) -> None:
    inbox = Inbox(consumer="dl")
    messages = batch_of(16)
    bad = {eid(messages[3]), eid(messages[11])}
    calls: list[int] = []
    handler = await failing_on(bad, calls)

    async def each(conn: asyncpg.Connection, message: Any) -> None:
        await handler(conn, [message])

    async def run() -> Any:
        if path == "batch":
            return await inbox.apply_batch(pool, messages, handler, on_error="dead_letter")
        return await inbox.apply_each(pool, messages, each, on_error="dead_letter")

    result = await run()
    assert (result.done, result.applied, result.dead_lettered) == (16, 14, 2)
    good = [eid(m) for m in messages if eid(m) not in bad]
    assert await applied(pool) == dict.fromkeys(good, 1)
    rows = await pool.fetch(
        "SELECT event_id, consumer, topic, kafka_partition, kafka_offset, value, headers, error "
        "FROM inbox_dead_letter ORDER BY kafka_offset"
    )
    assert [(r["event_id"], r["kafka_offset"]) for r in rows] == [
        (eid(messages[3]), 3),
        (eid(messages[11]), 11),
    ]
    assert rows[0]["consumer"] == "dl"
    assert rows[0]["value"] == b"v3"
    assert rows[0]["error"] == "RuntimeError: bad order"
    assert '"outbox-event-id"' in rows[0]["headers"]
    # A redelivery of the whole batch: every message a repeat, nothing recorded twice.
    again = await run()
    assert (again.applied, again.dead_lettered, again.duplicates) == (0, 0, 16)
    assert await pool.fetchval("SELECT count(*) FROM inbox_dead_letter") == 2
    assert await pool.fetchval("SELECT count(*) FROM applied") == 14


async def test_a_bad_id_ends_the_batch_after_the_ones_before_it(pool: asyncpg.Pool) -> None:
    messages = batch_of(5)
    messages[3] = Msg([("outbox-event-id", b"not-a-uuid")], offset=3)
    inbox = Inbox()
    with pytest.raises(BadEventId) as raised:
        await inbox.apply_batch(pool, messages, bulk)
    assert raised.value.result is not None
    assert raised.value.result.done == 3
    assert set(await applied(pool)) == {eid(m) for m in messages[:3]}
    # Under on_bad_id="skip" the batch goes through, the bad message unapplied.
    skip = Inbox(on_bad_id="skip")
    result = await skip.apply_batch(pool, messages, bulk)
    assert (result.done, result.applied, result.duplicates) == (5, 1, 3)
    assert skip.counts["bad_id_skipped"] == 1


async def test_an_error_outside_the_handler_is_not_blamed_on_a_message(
    empty_db_dsn: str,
) -> None:
    async with connect(empty_db_dsn) as conn:
        # No inbox table: the claim fails, and no message may be dead-lettered for it.
        with pytest.raises(Exception, match="migrate --inbox"):
            await Inbox().apply_batch(conn, batch_of(3), bulk, on_error="dead_letter")


# --- open transactions, isolation -------------------------------------------------------------


async def test_a_connection_inside_a_transaction_is_refused(pool: asyncpg.Pool) -> None:
    """asyncpg would make the inbox's transaction a savepoint: its "commit" would move Redis
    and the offsets before the outer transaction commits, and a rollback would lose the event."""
    inbox = Inbox()
    msg = batch_of(1)
    async with pool.acquire() as conn:
        async with conn.transaction():
            with pytest.raises(InTransaction, match="inside an open transaction"):
                await inbox.apply(conn, msg[0], one)
            with pytest.raises(InTransaction):
                await inbox.apply_batch(conn, msg, bulk)
            with pytest.raises(InTransaction):
                await inbox.apply_each(conn, msg, one)
            with pytest.raises(InTransaction):
                await consume(object(), conn, one, inbox=inbox)
        # Nothing was recorded; outside the transaction the same connection works.
        assert await conn.fetchval("SELECT count(*) FROM inbox") == 0
        assert await inbox.apply(conn, msg[0], one) is True


async def wait_until_blocked(db: asyncpg.Pool, pid: int) -> None:
    """Until the backend ``pid`` waits on a lock (a condition with a deadline, not a sleep)."""
    query = "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1"
    with anyio.fail_after(10):
        while True:
            if await db.fetchval(query, pid) == "Lock":
                return
            await anyio.sleep(0.01)


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
@pytest.mark.parametrize("path", ["apply", "batch"])
async def test_the_isolation_race_is_retried(
    empty_db_dsn: str, pool: asyncpg.Pool, isolation: str, path: str
) -> None:
    """Two consumers with one message (a rebalance): the second waits on the primary key and,
    under REPEATABLE READ or SERIALIZABLE, fails with a serialization error when the first
    commits. The inbox runs its transaction again, which sees the id: a repeat, no error."""
    strict = await asyncpg.connect(
        empty_db_dsn, server_settings={"default_transaction_isolation": isolation}
    )
    inbox = Inbox()
    messages = batch_of(3)
    try:
        async with pool.acquire() as first:
            tx = first.transaction()
            await tx.start()
            assert await inbox.claim_batch(first, [eid(messages[1])]) == {eid(messages[1])}
            await one(first, messages[1])
            if path == "apply":
                second = asyncio.create_task(inbox.apply(strict, messages[1], one))
            else:
                second = asyncio.create_task(inbox.apply_batch(strict, messages, bulk))
            await wait_until_blocked(pool, strict.get_server_pid())
            await tx.commit()
        outcome = await second
    finally:
        await strict.close()
    if path == "apply":
        assert outcome is False
        expected = [eid(messages[1])]
    else:
        assert (outcome.applied, outcome.duplicates) == (2, 1)
        expected = list(map(eid, messages))
    assert inbox.counts["retried"] >= 1
    assert await applied(pool) == dict.fromkeys(expected, 1)


# --- the Kafka loops --------------------------------------------------------------------------


async def produce(bootstrap: str, topic: str, ids: list[str], partition: int | None = None) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    await producer.start()
    try:
        for e in ids:
            await producer.send(
                topic,
                f"v-{e}".encode(),
                key=e.encode(),
                headers=[("outbox-event-id", e.encode())],
                partition=partition,
            )
        await producer.flush()
    finally:
        await producer.stop()


def group_consumer(services: Services, topic: str) -> AIOKafkaConsumer:
    """A consumer of a new group on ``topic``, from its start, committing offsets by hand."""
    return AIOKafkaConsumer(
        topic,
        bootstrap_servers=services.bootstrap,
        group_id=f"g-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )


async def wait_committed(consumer: AIOKafkaConsumer, topic: str, task: asyncio.Task[None]) -> None:
    tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
    ends = await consumer.end_offsets(tps)
    deadline = time.monotonic() + 60
    while True:
        committed = {tp: await consumer.committed(tp) for tp in tps}
        if all((committed[tp] or 0) >= ends[tp] for tp in tps):
            return
        assert not task.done(), task.exception()
        assert time.monotonic() < deadline, f"offsets not committed: {committed} vs {ends}"
        await asyncio.sleep(0.05)


async def until_committed(
    consumer: AIOKafkaConsumer, topic: str, loop: Coroutine[Any, Any, None]
) -> None:
    """Run a consume ``loop`` until every offset of ``topic`` is committed, then cancel it."""
    task = asyncio.create_task(loop)
    try:
        await wait_committed(consumer, topic, task)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("path", ["consume", "consume_batches"])
async def test_the_loops_apply_each_event_once_and_commit_offsets(
    pool: asyncpg.Pool, services: Services, topic: str, path: str
) -> None:
    ids = [str(uuid.uuid4()) for _ in range(300)]
    await produce(services.bootstrap, topic, [*ids, *ids[:100], ids[0]])
    group = f"g-{uuid.uuid4().hex[:8]}"
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=services.bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    inbox = Inbox(consumer=group)
    await consumer.start()
    try:
        if path == "consume":
            await until_committed(consumer, topic, consume(consumer, pool, one, inbox=inbox))
        else:
            loop = consume_batches(consumer, pool, bulk, inbox=inbox)
            await until_committed(consumer, topic, loop)
    finally:
        await consumer.stop()
    assert await applied(pool) == dict.fromkeys(ids, 1)
    assert inbox.counts["applied"] == 300
    assert inbox.counts["duplicate"] == 101


async def test_a_handler_error_commits_the_offsets_before_it_and_stops(
    pool: asyncpg.Pool, services: Services
) -> None:
    topic = f"t-{uuid.uuid4().hex[:12]}"
    await create_topics(services.bootstrap, [topic], partitions=1)
    ids = [str(uuid.uuid4()) for _ in range(50)]
    await produce(services.bootstrap, topic, ids)
    consumer = group_consumer(services, topic)
    handler = await failing_on({ids[37]}, [])
    await consumer.start()
    try:
        with pytest.raises(HandlerFailed, match="offset 37"):
            await consume_batches(consumer, pool, handler, inbox=Inbox())
        assert await consumer.committed(TopicPartition(topic, 0)) == 37
    finally:
        await consumer.stop()
    assert set(await applied(pool)) == set(ids[:37])


class WatchedListener(InboxRebalanceListener):
    """The inbox's listener, telling the test when a revoke begins and ends."""

    def __init__(self) -> None:
        super().__init__()
        self.revoking = anyio.Event()
        self.finished = anyio.Event()

    async def on_partitions_revoked(self, revoked: Any) -> None:
        if revoked:
            self.revoking.set()
        await super().on_partitions_revoked(revoked)
        if revoked:
            self.finished.set()


async def all_applied(
    db: asyncpg.Pool, ids: Sequence[str], tasks: list[asyncio.Task[None]]
) -> None:
    """Until every id was applied; a group member that ended meanwhile fails the test."""
    with anyio.fail_after(60):
        while len(await applied(db)) < len(ids):
            for t in tasks:
                assert not t.done(), t.exception()
            await anyio.sleep(0.05)


async def cancelled(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t


async def test_a_rebalance_commits_the_batch_in_flight(
    pool: asyncpg.Pool, services: Services
) -> None:
    """A second member joins while the first is inside a batch: the revoke waits for that
    batch's database commit and commits its offset, so the new owner redelivers none of it."""
    topic = f"t-{uuid.uuid4().hex[:12]}"
    await create_topics(services.bootstrap, [topic], partitions=2)
    ids = [str(uuid.uuid4()) for _ in range(200)]
    await produce(services.bootstrap, topic, ids[:100], partition=0)
    await produce(services.bootstrap, topic, ids[100:], partition=1)
    group = f"g-{uuid.uuid4().hex[:8]}"

    def member(name: str) -> AIOKafkaConsumer:
        return AIOKafkaConsumer(
            bootstrap_servers=services.bootstrap,
            group_id=group,
            client_id=name,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=10_000,
            heartbeat_interval_ms=300,
        )

    entered, release = anyio.Event(), anyio.Event()
    by: dict[str, list[str]] = {"a": [], "b": []}

    def handler_for(name: str) -> Any:
        async def handler(conn: asyncpg.Connection, messages: list[Any]) -> None:
            if name == "a" and not entered.is_set():
                entered.set()
                await release.wait()  # the first batch is in flight during the rebalance
            by[name].extend(eid(m) for m in messages)
            await bulk(conn, messages)

        return handler

    a, b = member("a"), member("b")
    listener = WatchedListener()
    a.subscribe([topic], listener=listener)
    inbox_a, inbox_b = Inbox(consumer=group), Inbox(consumer=group)
    await a.start()
    tasks: list[asyncio.Task[None]] = []
    try:
        tasks.append(
            asyncio.create_task(
                consume_batches(
                    a, pool, handler_for("a"), inbox=inbox_a, max_records=50, listener=listener
                )
            )
        )
        with anyio.fail_after(30):
            await entered.wait()
        b.subscribe([topic])

        async def second_member() -> None:
            # b.start() returns once b joined the group, which needs a's rejoin, which waits
            # for a's batch in flight: so not awaited here, where the test releases that batch.
            await b.start()
            await consume_batches(b, pool, handler_for("b"), inbox=inbox_b, max_records=50)

        tasks.append(asyncio.create_task(second_member()))
        with anyio.fail_after(30):
            await listener.revoking.wait()
        release.set()
        with anyio.fail_after(30):
            await listener.finished.wait()

        await all_applied(pool, ids, tasks)
    finally:
        await cancelled(tasks)
        await a.stop()
        await b.stop()
    assert await applied(pool) == dict.fromkeys(ids, 1)
    # The batch in flight was committed with its offset: nobody got it again.
    assert inbox_a.counts["duplicate"] + inbox_b.counts["duplicate"] == 0
    assert by["b"], "the second member never got a partition: no rebalance was exercised"


class Recorder(ConsumerRebalanceListener):  # type: ignore[misc]
    """A listener of the application's own, for consume(topics=...) to chain: a plain
    ``on_partitions_assigned`` and an ``async`` ``on_partitions_revoked`` (aiokafka takes
    both), which notes the revoked partitions' committed offsets as it is called."""

    def __init__(self, consumer: AIOKafkaConsumer) -> None:
        self.consumer = consumer
        self.assigned: list[set[TopicPartition]] = []
        self.committed_at_revoke: dict[TopicPartition, int | None] = {}
        self.revoked = anyio.Event()

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.assigned.append(set(assigned))

    async def on_partitions_revoked(self, revoked: Any) -> None:
        if revoked:
            for tp in revoked:
                self.committed_at_revoke[tp] = await self.consumer.committed(tp)
            self.revoked.set()


class RevokeSeen(logging.Handler):
    """aiokafka's log line "Revoking previously assigned partitions ..." (logged by the group
    coordinator just before it calls the listener) with partitions in it, as an event."""

    def __init__(self) -> None:
        super().__init__()
        self.event = anyio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("Revoking previously assigned") and record.args:
            revoked = record.args[0]  # type: ignore[index]
            if revoked:
                self.event.set()


async def test_consume_subscribes_with_its_listener_and_chains_yours(
    pool: asyncpg.Pool, services: Services
) -> None:
    """consume(topics=...) subscribes the consumer itself (aiokafka's public subscribe) with
    the inbox's listener, chained to the application's: on a rebalance, the batch in flight
    is committed (database and offset) before the application's on_partitions_revoked runs,
    and the new owner redelivers none of it."""
    topic = f"t-{uuid.uuid4().hex[:12]}"
    await create_topics(services.bootstrap, [topic], partitions=2)
    ids = [str(uuid.uuid4()) for _ in range(200)]
    await produce(services.bootstrap, topic, ids[:100], partition=0)
    await produce(services.bootstrap, topic, ids[100:], partition=1)
    group = f"g-{uuid.uuid4().hex[:8]}"

    def member(name: str) -> AIOKafkaConsumer:
        return AIOKafkaConsumer(
            bootstrap_servers=services.bootstrap,
            group_id=group,
            client_id=name,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=10_000,
            heartbeat_interval_ms=300,
        )

    entered, release = anyio.Event(), anyio.Event()
    in_flight: list[Any] = []

    def handler_for(name: str) -> Any:
        async def handler(conn: asyncpg.Connection, messages: list[Any]) -> None:
            if name == "a" and not entered.is_set():
                in_flight.extend(messages)
                entered.set()
                await release.wait()  # the first batch is in flight during the rebalance
            await bulk(conn, messages)

        return handler

    a, b = member("a"), member("b")  # neither subscribed: consume does it
    revoke_seen = RevokeSeen()
    coordinator_log = logging.getLogger("aiokafka.consumer.group_coordinator")
    coordinator_log.addHandler(revoke_seen)
    level = coordinator_log.level
    coordinator_log.setLevel(logging.INFO)
    recorder = Recorder(a)
    inbox_a, inbox_b = Inbox(consumer=group), Inbox(consumer=group)
    await a.start()
    tasks: list[asyncio.Task[None]] = []
    try:
        tasks.append(
            asyncio.create_task(
                consume_batches(
                    a,
                    pool,
                    handler_for("a"),
                    inbox=inbox_a,
                    max_records=50,
                    topics=[topic],
                    listener=recorder,
                )
            )
        )
        with anyio.fail_after(30):
            await entered.wait()
        assert recorder.assigned, "the chained listener was not told of the assignment"

        async def second_member() -> None:
            await b.start()
            await consume_batches(
                b, pool, handler_for("b"), inbox=inbox_b, max_records=50, topics=[topic]
            )

        tasks.append(asyncio.create_task(second_member()))
        # a's coordinator begins the revoke while a's batch is held.
        with anyio.fail_after(30):
            await revoke_seen.event.wait()
        assert not recorder.revoked.is_set(), "the chain ran before the batch in flight ended"
        release.set()
        with anyio.fail_after(30):
            await recorder.revoked.wait()

        await all_applied(pool, ids, tasks)
    finally:
        await cancelled(tasks)
        await a.stop()
        await b.stop()
        coordinator_log.removeHandler(revoke_seen)
        coordinator_log.setLevel(level)
    duplicates = {"a": inbox_a.counts["duplicate"], "b": inbox_b.counts["duplicate"]}
    assert await applied(pool) == dict.fromkeys(ids, 1)
    # By the time the application's listener ran, the batch in flight had its offset committed.
    tp = TopicPartition(topic, in_flight[-1].partition)
    assert recorder.committed_at_revoke.get(tp) == in_flight[-1].offset + 1
    assert duplicates == {"a": 0, "b": 0}, "a rebalance redelivered the batch in flight"
    assert inbox_b.counts["applied"] > 0, "the second member never got a partition"


async def test_the_loops_check_their_rebalance_arguments() -> None:
    """A listener of the application's own needs topics (consume subscribes with it chained);
    a string is not a list of topics; a chain must be a ConsumerRebalanceListener."""

    class Subscribing:
        _enable_auto_commit = False

        def subscribe(self, topics: list[str], listener: Any = None) -> None:
            raise AssertionError("subscribed despite bad arguments")

    class Mine(ConsumerRebalanceListener):  # type: ignore[misc]
        def on_partitions_revoked(self, revoked: Any) -> None:
            pass

        def on_partitions_assigned(self, assigned: Any) -> None:
            pass

    mine = Mine()
    with pytest.raises(ConfigurationError, match="needs topics="):
        await consume(Subscribing(), object(), one, inbox=Inbox(), listener=mine)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="not one string"):
        await consume_batches(Subscribing(), object(), bulk, inbox=Inbox(), topics="orders")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="at least one topic"):
        await consume_batches(Subscribing(), object(), bulk, inbox=Inbox(), topics=[])  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="chain must be"):
        InboxRebalanceListener(chain=object())  # type: ignore[arg-type]


# --- partitions in parallel -------------------------------------------------------------------


async def test_partition_batches_overlap_with_concurrency_and_keep_their_order(
    pool: asyncpg.Pool, services: Services
) -> None:
    """``concurrency=3`` with a pool: batches of different partitions of one fetch are in the
    handler at the same time, each partition's messages still arrive in offset order, each
    once, and every offset is committed."""
    topic = f"t-{uuid.uuid4().hex[:12]}"
    await create_topics(services.bootstrap, [topic], partitions=3)
    ids = {p: [str(uuid.uuid4()) for _ in range(60)] for p in range(3)}
    for p, pids in ids.items():
        await produce(services.bootstrap, topic, pids, partition=p)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    in_flight = 0
    overlapped = anyio.Event()

    async def handler(conn: asyncpg.Connection, messages: list[Any]) -> None:
        nonlocal in_flight
        in_flight += 1
        try:
            if in_flight >= 2:
                overlapped.set()
            # Run one after the other, no batch ever sees another in flight: each waits its
            # bound here and the assertion below fails.
            with anyio.move_on_after(5):
                await overlapped.wait()
            await bulk(conn, messages)
            for m in messages:
                seen[m.partition].append(m.offset)
        finally:
            in_flight -= 1

    consumer = group_consumer(services, topic)
    await consumer.start()
    try:
        loop = consume_batches(consumer, pool, handler, inbox=Inbox(), concurrency=3)
        await until_committed(consumer, topic, loop)
    finally:
        await consumer.stop()
    assert overlapped.is_set(), "no two partitions' batches were ever in the handler at once"
    assert seen == {p: list(range(60)) for p in range(3)}
    assert await applied(pool) == dict.fromkeys([e for p in ids.values() for e in p], 1)


async def test_a_failing_partition_stops_the_loop_with_its_offset_before_the_failure(
    pool: asyncpg.Pool, services: Services
) -> None:
    """With ``concurrency``, a handler failure in one partition still commits exactly the
    messages before it in that partition, and stops the loop."""
    topic = f"t-{uuid.uuid4().hex[:12]}"
    await create_topics(services.bootstrap, [topic], partitions=3)
    ids = {p: [str(uuid.uuid4()) for _ in range(40)] for p in range(3)}
    for p, pids in ids.items():
        await produce(services.bootstrap, topic, pids, partition=p)
    consumer = group_consumer(services, topic)
    handler = await failing_on({ids[1][23]}, [])
    await consumer.start()
    try:
        with pytest.raises(HandlerFailed, match="offset 23"):
            await consume_batches(consumer, pool, handler, inbox=Inbox(), concurrency=3)
        assert await consumer.committed(TopicPartition(topic, 1)) == 23
    finally:
        await consumer.stop()
    done = set(await applied(pool))
    assert set(ids[1][:23]) <= done
    assert not done & set(ids[1][23:])


async def test_concurrency_needs_a_pool_and_a_positive_number(pool: asyncpg.Pool) -> None:
    class Consumer:
        _enable_auto_commit = False

        def subscribe(self, topics: list[str], listener: Any = None) -> None:
            raise AssertionError("subscribed despite bad arguments")

    async with pool.acquire() as conn:
        with pytest.raises(ConfigurationError, match="needs an asyncpg pool"):
            await consume_batches(Consumer(), conn, bulk, inbox=Inbox(), concurrency=2)
    with pytest.raises(ConfigurationError, match="at least 1"):
        await consume(Consumer(), pool, one, inbox=Inbox(), concurrency=0)
