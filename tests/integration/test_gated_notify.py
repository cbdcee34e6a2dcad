"""The gated notify (migrations 0002 and 0006) against a real PostgreSQL: producers NOTIFY only
while no relay is awake, the awake marker lapses when a relay stops renewing it, and no
committed event ever waits for the fallback poll because a producer skipped its NOTIFY."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import asyncpg
import pytest

from notify_outbox import OutboxNames, OutboxSettings, Relay
from notify_outbox.core.events import RelayEvents
from notify_outbox.pg.sqlfiles import Queries
from tests.conftest import Services
from tests.faults.harness import eventually
from tests.support import RelayProcess, consume, topic_total

pytestmark = pytest.mark.anyio

Q = Queries(OutboxNames())
INSERT = "INSERT INTO outbox (topic, key, payload) VALUES ('t', $1, '{}')"


class Notifications:
    """A LISTEN connection that tells whether a NOTIFY came before a sentinel. PostgreSQL
    delivers notifications in commit order, so "no wake-up before the sentinel" proves the
    producer did not notify, without waiting for an absence."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.queue: asyncio.Queue[str] = asyncio.Queue()

    async def start(self) -> None:
        await self.conn.add_listener("notify_outbox", lambda *a: self.queue.put_nowait(a[3]))

    async def notified_before_sentinel(self, sender: asyncpg.Connection) -> bool:
        await sender.execute("SELECT pg_notify('notify_outbox', 'sentinel')")
        seen = False
        with anyio.fail_after(10):
            while (payload := await self.queue.get()) != "sentinel":
                seen = seen or payload == "public.outbox"  # the trigger names its outbox (0008)
        return seen


# Epochs long enough that a marker taken once stays held for the whole of a test's steps.
LONG_EPOCH_MS = 60_000


async def mark_awake(relay: asyncpg.Connection, epoch_ms: int = LONG_EPOCH_MS) -> list[int]:
    """Take the awake marker as a relay does (migration 0006): the epochs held."""
    held: list[int] = await relay.fetchval(Q["hold_awake"], [], epoch_ms)
    assert held
    return held


async def use_epochs(conn: asyncpg.Connection, epoch_ms: int) -> None:
    await conn.execute("UPDATE outbox_config SET awake_epoch_ms = $1", epoch_ms)


@asynccontextmanager
async def connections(dsn: str, n: int) -> AsyncIterator[list[asyncpg.Connection]]:
    conns = [await asyncpg.connect(dsn) for _ in range(n)]
    try:
        yield conns
    finally:
        for c in conns:
            await c.close()


async def test_producers_skip_notify_only_while_a_relay_is_awake(db_dsn: str) -> None:
    async with connections(db_dsn, 4) as (relay, producer, other, listen_conn):
        await use_epochs(other, LONG_EPOCH_MS)
        heard = Notifications(listen_conn)
        await heard.start()
        await producer.execute(INSERT, "k")
        assert await heard.notified_before_sentinel(other)  # asleep: producers notify

        held = await mark_awake(relay)
        await producer.execute(INSERT, "k")
        assert not await heard.notified_before_sentinel(other)  # awake: no NOTIFY lock
        # Any isolation level, several statements, one transaction: still skipped.
        async with producer.transaction(isolation="repeatable_read"):
            await producer.execute(INSERT, "k")
            await producer.execute(INSERT, "j")
        assert not await heard.notified_before_sentinel(other)

        # A producer in flight (it holds G) keeps the relay awake: the release must fail.
        tx = producer.transaction(isolation="serializable")
        await tx.start()
        await producer.execute(INSERT, "k")
        assert await relay.fetchval(Q["try_sleep"], held) is False
        await producer.execute(INSERT, "k")  # the failed try let go of nothing
        await tx.commit()
        assert not await heard.notified_before_sentinel(other)
        assert await relay.fetchval(Q["try_sleep"], held) is True
        await producer.execute(INSERT, "k")
        assert await heard.notified_before_sentinel(other)  # asleep again: producers notify

        # 'always' ignores the marker; 'off' never notifies.
        held = await mark_awake(relay)
        await other.execute(Q["set_notify_mode"], "always")
        await producer.execute(INSERT, "k")
        assert await heard.notified_before_sentinel(other)
        await relay.fetchval(Q["try_sleep"], held)
        await other.execute(Q["set_notify_mode"], "off")
        await producer.execute(INSERT, "k")
        assert not await heard.notified_before_sentinel(other)


async def test_the_marker_lapses_unless_renewed(db_dsn: str) -> None:
    """A relay that stops renewing the marker (frozen, or cut off from Kafka) stops holding
    producers' NOTIFYs back within two epochs; one that renews it keeps it (migration 0006)."""
    epoch_ms = 200
    async with connections(db_dsn, 4) as (relay, producer, other, listen_conn):
        await use_epochs(other, epoch_ms)
        heard = Notifications(listen_conn)
        await heard.start()
        held = await mark_awake(relay, epoch_ms)
        assert held == [held[0], held[0] + 1]  # this epoch and the next
        await producer.execute(INSERT, "k")
        assert not await heard.notified_before_sentinel(other)

        # Renewed in a later epoch: the older epoch is let go, the new ones are taken.
        async def epoch_past(last: int) -> bool:
            return bool(await other.fetchval("SELECT outbox_awake_epoch($1)", epoch_ms) > last)

        await eventually(lambda: epoch_past(held[0]), within=10, what="the next epoch")
        renewed: list[int] = await relay.fetchval(Q["hold_awake"], held, epoch_ms)
        assert held[0] not in renewed
        assert held[1] in renewed
        await producer.execute(INSERT, "k")
        assert not await heard.notified_before_sentinel(other)

        # Not renewed: once the database's clock is past the last epoch held, producers notify.
        await eventually(lambda: epoch_past(max(renewed)), within=10, what="epochs past")
        await producer.execute(INSERT, "k")
        assert await heard.notified_before_sentinel(other)
        # The sleep protocol still lets go of whatever is held.
        assert await relay.fetchval(Q["try_sleep"], renewed) is True
        assert await relay.fetchval(Q["hold_awake"], [], epoch_ms)  # nothing was left held


async def test_producers_never_queue_behind_a_relay_going_to_sleep(db_dsn: str) -> None:
    """The relay only ever tries G: a producer holding G shared makes try_sleep answer False
    at once, and new producers get G shared meanwhile (nothing waits)."""
    async with connections(db_dsn, 3) as (relay, p1, p2):
        await use_epochs(p1, LONG_EPOCH_MS)
        held = await mark_awake(relay)
        await p1.execute("SET lock_timeout = '100ms'")
        await p2.execute("SET lock_timeout = '100ms'")
        tx = p1.transaction()
        await tx.start()
        await p1.execute(INSERT, "a")
        with anyio.fail_after(1):
            assert await relay.fetchval(Q["try_sleep"], held) is False
        await p2.execute(INSERT, "b")  # would hit lock_timeout if it queued behind the relay
        await tx.commit()


async def test_thousands_of_sleep_wake_cycles_never_need_the_fallback_poll(
    db_dsn: str, services: Services, topic: str
) -> None:
    """2000 rounds against a gated relay whose fallback poll is effectively off. In each
    round, writers start at random offsets (0-4 ms) so that some commit while the relay is
    lingering or going to sleep; transactions abort after the trigger ran, hold several
    statements, and use every isolation level. Every round must end with every committed
    event published and one more sleep/wake cycle done; every 100th round kills the listening
    connection while the relay is awake (its marker dies with it). A lost wake-up would stall
    a round: nothing but a NOTIFY or the reconnect catch-up can wake this relay."""
    settings = OutboxSettings(
        dsn=db_dsn,
        kafka_bootstrap_servers=services.bootstrap,
        workers=3,
        poll_interval=3600,
        gate_linger=0.002,
        gate_poll_interval=0.001,
        gate_awake_after=0,  # every round marks the relay awake
        gate_awake_rate=0,  # whatever its rate
        reconnect_min_delay=0.01,
    )
    rounds, committed, aborted = 2000, 0, 0
    rng = random.Random(20261122)
    print(f"\ngated soak seed 20261122, {rounds} rounds")

    async def write(conn: asyncpg.Connection) -> None:
        nonlocal committed, aborted
        await anyio.sleep(rng.uniform(0, 0.004))
        isolation = rng.choice(["read_committed", "repeatable_read", "serializable"])
        # Several keys in one transaction go in one global order, as the docs ask.
        keys = sorted(f"k{rng.randrange(20):02d}" for _ in range(rng.randint(1, 3)))
        abort = rng.random() < 0.15
        try:
            async with conn.transaction(isolation=isolation):
                for key in keys:
                    await conn.execute(
                        "INSERT INTO outbox (topic, key, payload) VALUES ($1, $2, '{}')",
                        topic,
                        key,
                    )
                if abort:
                    raise LookupError("abort after the trigger ran")
            committed += len(keys)
        except LookupError:
            aborted += 1

    async with connections(db_dsn, 4) as (admin, *writers), Relay(settings) as relay:
        assert relay.gate.enabled
        events = relay.events
        for n in range(rounds):
            cycles, listens = events.counts["gate_sleep"], events.counts["listening"]
            before = committed
            kill = n % 100 == 99
            async with anyio.create_task_group() as tg:
                for conn in writers:
                    tg.start_soon(write, conn)
                if kill:
                    await events.wait_for("gate_awake", events.counts["gate_awake"] + 1)
                    await admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE application_name = 'notify-outbox-listener' "
                        "AND datname = current_database()"
                    )
            with anyio.move_on_after(30) as scope:
                await events.wait_for("published", committed)
                if kill:  # the marker died with the connection: wait for the new LISTEN
                    await events.wait_for("listening", listens + 1)
                elif committed > before:
                    await events.wait_for("gate_sleep", cycles + 1)
            if scope.cancelled_caught:
                pending = await admin.fetch("SELECT id, next_attempt_at, xmin FROM outbox")
                raise AssertionError(
                    f"round {n} stalled: committed {committed}, pending {pending}, "
                    f"low-water mark {relay._store.marks.mark}, "
                    f"awake {relay.gate.awake}, "
                    f"counts {dict(events.counts)}"
                )
        records, _ = await consume(services.bootstrap, topic, expect=committed, within=60)
        counts = events.counts.copy()
    total = await topic_total(services.bootstrap, topic)  # the relay stopped
    assert total == committed
    assert len(records) == committed
    assert counts["wake:poll"] == 0
    assert counts["gate_sleep"] >= rounds * 0.8  # rounds where everything aborted have none
    assert counts["listener_lost"] == rounds // 100
    # The gate did suppress: fewer notifications than committed inserting transactions.
    assert counts["wake:notification"] < committed
    print(
        f"gated soak: {committed} events committed, {aborted} transactions aborted, "
        f"{counts['gate_sleep']} sleep/wake cycles, {counts['wake:notification']} "
        f"notifications, {counts['listener_lost']} listener kills, "
        f"{counts['wake:reconnect']} reconnect catch-ups, poll wake-ups {counts['wake:poll']}"
    )


async def test_the_awake_marker_dies_with_a_killed_relay(
    db_dsn: str, services: Services, topic: str
) -> None:
    awake = OutboxNames().awake_namespace & 0xFFFFFFFF  # pg_locks shows it as an oid
    held = (
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND objsubid = 2 AND classid::bigint = $1"
    )
    async with connections(db_dsn, 2) as (conn, listen_conn):
        with RelayProcess(
            db_dsn, services.bootstrap, env={"NOTIFY_OUTBOX_GATE_LINGER": "5"}
        ) as relay:
            relay.wait_ready()
            # Sustained traffic: the relay marks itself awake, then lingers for 5 s.
            await conn.execute(
                "INSERT INTO outbox (topic, key, payload) SELECT $1, 'k' || i, '{}' "
                "FROM generate_series(1, 2000) i",
                topic,
            )
            with anyio.fail_after(30):
                while not await conn.fetchval(held, awake):
                    await conn.execute(INSERT.replace("'t'", "$2"), "k", topic)
            relay.signal(signal.SIGKILL)
            relay.wait(30)

        # The marker's locks go with the dead session (whatever their epochs).
        async def released() -> bool:
            return not await conn.fetchval(held, awake)

        await eventually(released, within=30, what="the dead relay's marker is released")
        heard = Notifications(listen_conn)
        await heard.start()
        await conn.execute(INSERT, "k")
        assert await heard.notified_before_sentinel(conn)


async def test_a_marker_renewed_after_its_epochs_ended_says_so(
    db_dsn: str, services: Services, topic: str
) -> None:
    """An awake relay whose event loop stalls past the epochs it holds renews its marker late:
    producers notified in between (as they should), and the gate counts it (``gate_lapse``).
    The stream is the steady one of the next test, which marks the relay awake."""
    settings = OutboxSettings(
        dsn=db_dsn, kafka_bootstrap_servers=services.bootstrap, workers=4, gate_awake_rate=100
    )
    insert = "INSERT INTO outbox (topic, key, payload) VALUES ($1, $2, '{}')"
    async with connections(db_dsn, 2) as producers, Relay(settings) as relay:
        events = relay.events
        stop = anyio.Event()

        async def produce(conn: asyncpg.Connection, first: int) -> None:
            n = first
            while not stop.is_set():
                await conn.execute(insert, topic, f"k{n % 40}")
                n += 2
                await anyio.sleep(0.004)  # pacing the stream

        with anyio.fail_after(40):
            async with anyio.create_task_group() as tg:
                for i, conn in enumerate(producers):
                    tg.start_soon(produce, conn, i)
                await events.wait_for("gate_awake")
                await events.wait_for("gate_renewed", events.counts["gate_renewed"] + 4)
                lapses = events.counts["gate_lapse"]
                # The whole event loop stalls for four epochs (the relay runs in this process):
                # no renewal can run in time. A deliberate stall, not a wait.
                time.sleep(4 * relay.gate.epoch_ms / 1000)  # noqa: ASYNC251
                await events.wait_for("gate_lapse", lapses + 1)
                stop.set()


async def test_a_steady_stream_shared_by_several_workers_marks_the_relay_awake(
    db_dsn: str, services: Services, topic: str
) -> None:
    """A steady stream (here about 500 ev/s from two connections) that the relay's workers
    take in turns, each claim a few rows: no worker drains long on its own, but the relay has
    had one claiming all along, so it marks itself awake and producers stop notifying. (On a
    quiet host a single worker's run gets there too; the bench's held snapshot showed where
    it did not: at 800 ev/s beside PostgreSQL, Kafka and the producers, a relay whose runs
    counted per worker stayed notified per commit, at twice the latency, for 20-60 s.) The
    rate that marks a relay awake is lowered below this stream's (``gate_awake_rate``, tested
    on its own below): what is tested here is how the run is counted."""
    settings = OutboxSettings(
        dsn=db_dsn, kafka_bootstrap_servers=services.bootstrap, workers=4, gate_awake_rate=100
    )
    insert = "INSERT INTO outbox (topic, key, payload) VALUES ($1, $2, '{}')"
    async with connections(db_dsn, 4) as conns, Relay(settings) as relay:
        producers, (listen_conn, other) = conns[:2], conns[2:]
        heard = Notifications(listen_conn)
        await heard.start()
        events = relay.events
        sent = 0
        stop = anyio.Event()
        # Set once ``sent`` reaches ``target[0]``.
        target: tuple[int, anyio.Event] = (0, anyio.Event())

        async def produce(conn: asyncpg.Connection, first: int) -> None:
            nonlocal sent
            n = first
            while not stop.is_set():
                await conn.execute(insert, topic, f"k{n % 40}")
                sent += 1
                if sent >= target[0]:
                    target[1].set()
                n += 2
                await anyio.sleep(0.004)

        async def notified_while_awake() -> bool:
            """Whether the stream's commits notified between two sentinels while the relay
            stayed awake (the first sentinel passes the NOTIFYs of the commits before the
            marker was taken, and of those in flight when it was). A round in which the relay
            went to sleep, or renewed its marker only after the epochs it held had ended (it
            says so: ``gate_lapse``; a late wake-up on a loaded host), is run again: producers
            rightly notify then."""
            for _ in range(5):
                sleeps, lapses = events.counts["gate_sleep"], events.counts["gate_lapse"]
                await heard.notified_before_sentinel(other)
                nonlocal target
                target = (sent + 50, anyio.Event())  # 50 commits of the stream, then look
                await target[1].wait()
                notified = await heard.notified_before_sentinel(other)
                # A gap that began before the sentinel ends at the next renewal: wait for it.
                await events.wait_for("gate_renewed", events.counts["gate_renewed"] + 1)
                slept = events.counts["gate_sleep"] != sleeps
                if (
                    not slept
                    and events.counts["gate_lapse"] == lapses
                    and events.counts["gate_awake"]
                ):
                    return notified
                if slept:
                    await events.wait_for("gate_awake", events.counts["gate_awake"] + 1)
            raise AssertionError(
                f"the relay went to sleep or let its marker lapse in each of 5 rounds: "
                f"{events.counts}"
            )

        with anyio.fail_after(40):
            async with anyio.create_task_group() as tg:
                for i, conn in enumerate(producers):
                    tg.start_soon(produce, conn, i)
                await events.wait_for("gate_awake")
                # Marked awake, it stays awake while the stream goes on: producers stopped
                # notifying.
                notified = await notified_while_awake()
                stop.set()
        assert not notified, "the relay was marked awake, but the stream's commits notified"
        with anyio.fail_after(30):
            await events.wait_for("published", sent)


async def test_a_trickle_never_marks_the_relay_awake_but_a_backlog_does(
    db_dsn: str, services: Services, topic: str
) -> None:
    """At low load producers keep notifying (the latency of an always-notify trigger): one
    event at a time, each written once the relay is idle again after publishing the one
    before, never makes an unbroken run of claims, so the relay never marks itself awake. A
    backlog keeps it claiming without a break for longer than ``gate_awake_after``: it marks
    itself awake and producers stop notifying. (The run is the relay's, not one worker's:
    an event written while the worker that published the previous one is still committing
    continues the run, as a steady stream does.)"""
    settings = OutboxSettings(
        dsn=db_dsn, kafka_bootstrap_servers=services.bootstrap, workers=2, batch_size=50
    )
    insert = "INSERT INTO outbox (topic, key, payload) VALUES ($1, $2, '{}')"
    async with connections(db_dsn, 1) as (conn,), Relay(settings) as relay:
        events = relay.events
        for n in range(50):
            await conn.execute(insert, topic, f"k{n % 7}")
            with anyio.fail_after(10):
                await events.wait_for("published", n + 1)
                while relay.busy_workers:
                    await events.wait_for("idle", events.counts["idle"] + 1)
        assert events.counts["gate_awake"] == 0
        assert events.counts["wake:notification"] >= 50  # every event woke the relay
        await _a_backlog_marks_it_awake(conn, events, topic, published=50)
        assert events.counts["wake:poll"] == 0


async def test_below_the_awake_rate_producers_keep_notifying_even_with_no_break(
    db_dsn: str, services: Services, topic: str
) -> None:
    """``gate_awake_rate``: an awake relay finds rows only by looking every
    ``gate_poll_interval``, which at low rates costs more latency than the NOTIFY it spares.
    With ``gate_awake_after`` 0 (the first claim with rows would mark the relay awake), events
    at a low rate still leave producers notifying, every one waking the relay; a backlog,
    claimed at thousands of rows per second, marks it awake."""
    settings = OutboxSettings(
        dsn=db_dsn,
        kafka_bootstrap_servers=services.bootstrap,
        workers=2,
        batch_size=50,
        gate_awake_after=0,
        gate_awake_rate=500,
    )
    insert = "INSERT INTO outbox (topic, key, payload) VALUES ($1, $2, '{}')"
    async with connections(db_dsn, 1) as (conn,), Relay(settings) as relay:
        events = relay.events
        for n in range(30):
            await conn.execute(insert, topic, f"k{n % 7}")
            with anyio.fail_after(10):
                await events.wait_for("published", n + 1)
        assert relay.gate.rate() < 500
        assert events.counts["gate_awake"] == 0
        assert events.counts["wake:notification"] >= 30
        await _a_backlog_marks_it_awake(conn, events, topic, published=30)


async def _a_backlog_marks_it_awake(
    conn: asyncpg.Connection, events: RelayEvents, topic: str, *, published: int
) -> None:
    """5,000 rows at once (claimed at thousands per second, without a break): once they are
    published (after the ``published`` before them), the relay has marked itself awake."""
    await conn.execute(
        "INSERT INTO outbox (topic, key, payload) "
        "SELECT $1, 'k' || (i % 97), '{}' FROM generate_series(1, 5000) i",
        topic,
    )
    with anyio.fail_after(60):
        await events.wait_for("published", published + 5000)
    assert events.counts["gate_awake"] >= 1
