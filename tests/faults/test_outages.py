"""PostgreSQL and Kafka go away and come back while the application keeps writing.

Scenarios (reliability.md): 7 PostgreSQL restart mid-stream, 12 Kafka down while the app
inserts, 13 SIGTERM while Kafka is down (and 10's second signal: abort at once).

These restart the session's shared services; the suite's autouse fixture brings them back
if a test fails half-way.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from datetime import datetime

import anyio
import pytest

from tests.conftest import Services
from tests.faults.checker import FIGURES, OutboxChecker, Producer
from tests.faults.harness import (
    LISTENER_APP,
    FaultRelay,
    KafkaTail,
    connect,
    durable_commits,
    eventually,
    fetchval,
    idle_latency,
    pending_rows,
    relays,
    restartable,
    run_blocking,
    task_group,
)

pytestmark = pytest.mark.anyio

KEEP = {"NOTIFY_OUTBOX_KEEP_PUBLISHED": "3600"}  # keep marked rows: marks stay visible


async def _db_now(dsn: str) -> datetime:
    value = await fetchval(dsn, "SELECT clock_timestamp()")
    assert isinstance(value, datetime)
    return value


async def _grows(get: object, target: int) -> bool:
    return bool(get() >= target)  # type: ignore[operator]


async def _drained(dsn: str) -> bool:
    return await pending_rows(dsn) == 0


async def _produce_until(p: Producer, done: Callable[[], bool]) -> None:
    with anyio.fail_after(60):
        while not done():
            await p.produce(f"key-{uuid.uuid4().int % 10}")
            await anyio.sleep(0.02)  # pacing the producer, not synchronisation


async def test_07_postgres_restart_mid_stream(db_dsn: str, services: Services, topic: str) -> None:
    """PostgreSQL stops (immediate: like a crash, then fast) and starts again under a relay and
    writers. The relay recovers by itself: no event lost, none rolled back published, order
    kept; only rows in flight at the restart may repeat; wake-ups work again after."""
    postgres, _ = restartable(services)
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "7 PG restart").setup()
    await durable_commits(db_dsn)
    checker.expect_writer_errors()
    load = checker.writers(writers=3, keys=20, pause=0.01)
    async with (
        relays(FaultRelay(db_dsn, services.bootstrap)) as (relay,),
        KafkaTail(services.bootstrap, [topic]) as tail,
        task_group() as tg,
    ):
        await relay.ready()
        tg.start_soon(load.run)
        for n, mode in enumerate(("immediate", "fast"), start=1):
            await eventually(
                lambda: _grows(lambda: load.produced, 150 * n),  # noqa: B023
                within=60,
                what="writers produced before the restart",
            )
            await run_blocking(lambda: postgres.stop(mode=mode))  # noqa: B023
            await run_blocking(postgres.start)
            healed = time.monotonic()
            checker.allow_duplicates(relay.in_flight_bound, f"PG restart ({mode})")
            async with checker.producer() as p:
                marker = await p.produce("marker")
            arrived = await tail.wait_for([marker], within=60, what=f"after PG stop {mode}")
            FIGURES.recovery("PG restart", arrived - healed)
        await load.halt()
        async with checker.producer() as p:
            await idle_latency(db_dsn, lambda: p.produce("idle"), tail, what="after PG restarts")
        report = await checker.drain_and_check(within=60)
        await relay.stop_ok()
    print(report.text())
    assert sum(load.ledger.errors.values()) > 0, "the writers never noticed the restarts"
    report.assert_ok()


async def test_07b_a_row_left_below_the_mark_by_a_failover_is_published_after_it(
    db_dsn: str, services: Services, topic: str
) -> None:
    """A failover to an asynchronous standby loses the transactions the standby had not
    received, claims' marks among them: their rows are pending again, below the relay's
    low-water mark, where no claim from that mark reads. Simulated: PostgreSQL restarts (its
    start time changes, as it differs on the server that takes over), and a row the relay
    published is made pending again, as a lost mark leaves it. The relay's fallback poll sees
    the new start time, drops its mark, and the row is published again."""
    postgres, _ = restartable(services)
    await durable_commits(db_dsn)  # nothing but the row made pending by hand is lost
    env = {**KEEP, "NOTIFY_OUTBOX_POLL_INTERVAL": "0.5"}
    insert = "INSERT INTO outbox (topic, key, payload) VALUES ($1, $2, '{}') RETURNING id"
    async with (
        relays(FaultRelay(db_dsn, services.bootstrap, env=env)) as (relay,),
        KafkaTail(services.bootstrap, [topic]) as tail,
    ):
        await relay.ready()
        async with connect(db_dsn) as conn:
            ids = [await conn.fetchval(insert, topic, f"k{n}") for n in range(20)]
        await eventually(lambda: _drained(db_dsn), within=30, what="the 20 rows published")
        await eventually(lambda: _grows(lambda: tail.messages, 20), within=30, what="in Kafka")
        await run_blocking(lambda: postgres.stop(mode="immediate"))
        await run_blocking(postgres.start)
        lost = ids[0]
        async with connect(db_dsn) as conn:
            await conn.execute("UPDATE outbox SET published_at = NULL WHERE id = $1", lost)
            # The relay works again meanwhile: a new row goes at once, from the old mark.
            await conn.fetchval(insert, topic, "after")
        await eventually(
            lambda: _grows(lambda: tail.messages, 21), within=30, what="the new row in Kafka"
        )
        await eventually(
            lambda: _drained(db_dsn),
            within=30,
            what="the row left below the mark published again",
        )
        await relay.line("restarted or another took over", within=30)
        await eventually(
            lambda: _grows(lambda: tail.messages, 22), within=30, what="its second copy in Kafka"
        )
        await relay.stop_ok()


async def test_12_kafka_down_while_the_app_keeps_inserting(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Kafka stops while writers go on. Inserts keep working (I6); nothing is marked during
    the outage that Kafka had not acknowledged before it; when Kafka is back everything drains
    in order, by itself."""
    _, kafka = restartable(services)
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "12 Kafka down").setup()
    load = checker.writers(writers=3, keys=20, pause=0.01)
    # Batches queued during the outage outlive the producer's request timeout (as they do
    # with the default 10 s in any outage longer than that); 1.5 s makes it certain here.
    env = {**KEEP, "NOTIFY_OUTBOX_KAFKA_REQUEST_TIMEOUT_MS": "1500"}
    async with (
        relays(FaultRelay(db_dsn, services.bootstrap, env=env)) as (relay,),
        task_group() as tg,
        connect(db_dsn) as watch,
    ):
        await relay.ready()
        tg.start_soon(load.run)
        await eventually(
            lambda: _grows(lambda: load.produced, 200), within=60, what="writers are going"
        )
        await run_blocking(kafka.stop)
        down_at = await _db_now(db_dsn)
        checker.allow_duplicates(relay.in_flight_bound, "Kafka stop: acks lost in flight")
        during = checker.ledger.count("committed")
        await relay.line("Kafka unavailable", within=60)
        await eventually(
            lambda: _grows(lambda: checker.ledger.count("committed"), during + 200),
            within=60,
            what="the application keeps committing while Kafka is down",
        )
        state = await watch.fetchval(
            "SELECT state FROM pg_stat_activity WHERE application_name = $1 "
            "AND datname = current_database()",
            LISTENER_APP,
        )
        assert state in ("idle", "active"), f"listener is {state!r} during the outage"
        up_at = await _db_now(db_dsn)
        await run_blocking(kafka.start)
        healed = time.monotonic()
        async with KafkaTail(services.bootstrap, [topic]) as tail, checker.producer() as p:
            marker = await p.produce("marker")
            arrived = await tail.wait_for([marker], within=45, what="an event after Kafka is back")
            FIGURES.recovery("Kafka restart", arrived - healed)
            await load.halt()
            await idle_latency(db_dsn, lambda: p.produce("idle"), tail, what="after Kafka is back")
        report = await checker.drain_and_check(within=90)
        marked_in_outage = await watch.fetch(
            "SELECT event_id::text, published_at FROM outbox "
            "WHERE published_at > $1 AND published_at < $2",
            down_at,
            up_at,
        )
        committed_in_outage = await watch.fetchval(
            "SELECT count(*) FROM fault_commits WHERE committed_at > $1 AND committed_at < $2",
            down_at,
            up_at,
        )
        await relay.stop_ok()
    print(report.text())
    # A mark during the outage is only legitimate for a message Kafka took before it went.
    sent_at = {r.event_id: r.timestamp_ms / 1000 for r in reversed(report.records) if r.event_id}
    late = [
        e for e, marked in marked_in_outage if e not in sent_at or sent_at[e] >= down_at.timestamp()
    ]
    assert not late, f"{len(late)} rows marked during the outage without an earlier ack"
    max_commit = max(load.ledger.commit_latencies)
    FIGURES.notes["12: commits during the Kafka outage"] = committed_in_outage
    FIGURES.notes["12: slowest app commit (s)"] = round(max_commit, 3)
    # About 200 (a few in flight at either end of the window may fall outside it).
    assert committed_in_outage >= 150
    assert max_commit < 2.0, f"an application commit took {max_commit:.2f}s"
    report.assert_ok()


async def test_13_sigterm_while_kafka_is_down_and_a_second_signal_aborts(
    db_dsn: str, services: Services, topic: str
) -> None:
    """With Kafka down and batches in flight:
    relay A gets one SIGTERM while its batch waits for acks and must exit within its
    shutdown timeout (5 s; Kafka send deadline 3 s), leaving its unsent rows pending;
    relay B (send deadline 30 s, so its batch stays in flight) gets SIGTERM, starts its
    graceful stop, then a second signal, and must abort at once with exit code 130.
    Afterwards a new relay delivers everything."""
    _, kafka = restartable(services)
    checker = OutboxChecker(db_dsn, services.bootstrap, [topic], "13 SIGTERM, Kafka down")
    await checker.setup()
    shutdown = 5.0
    # Both must claim during the outage: an idle relay's Kafka check could see the broker
    # gone first, and then (rightly) claim nothing. So it is kept out of this test.
    no_idle_check = {"NOTIFY_OUTBOX_KAFKA_IDLE_CHECK_INTERVAL": "3600"}
    env_a = {
        **KEEP,
        **no_idle_check,
        "NOTIFY_OUTBOX_SHUTDOWN_TIMEOUT": str(shutdown),
        "NOTIFY_OUTBOX_KAFKA_SEND_TIMEOUT": "3",
    }
    env_b = {
        **KEEP,
        **no_idle_check,
        "NOTIFY_OUTBOX_SHUTDOWN_TIMEOUT": "30",
        "NOTIFY_OUTBOX_KAFKA_SEND_TIMEOUT": "30",
    }
    debug = ("--log-level", "DEBUG")
    a = FaultRelay(db_dsn, services.bootstrap, *debug, env=env_a, name="A")
    b = FaultRelay(db_dsn, services.bootstrap, *debug, env=env_b, name="B")
    async with relays(a, b), checker.producer() as p:
        await a.ready()
        await b.ready()
        claimed = r"claimed \d+ rows"
        # Both publish once first, so both producers know the topic: a relay that must still
        # ask Kafka for a topic's metadata gives up at once when Kafka is down, with nothing
        # in flight, and the stop would test nothing.
        await _produce_until(p, lambda: all(r.matching(claimed) for r in (a, b)))
        await eventually(lambda: _drained(db_dsn), within=30, what="nothing left pending")
        await run_blocking(kafka.stop)
        down_at = await _db_now(db_dsn)
        for relay in (a, b):
            checker.allow_duplicates(relay.in_flight_bound, f"Kafka stop under relay {relay.name}")
        # New events after the outage began, until A claims a batch: SIGTERM it right then,
        # while that batch waits for acks that cannot come (up to its 3 s send deadline).
        before_a, before_b = len(a.matching(claimed)), len(b.matching(claimed))
        await _produce_until(p, lambda: len(a.matching(claimed)) > before_a)
        # A generous deadline on the exit (load can slow any process down): without its
        # shutdown_timeout, A would wait for a broker that is down for as long as it stays down.
        code_a, took_a = await a.terminate(within=shutdown + 25)
        # B's send deadline and shutdown_timeout are 30 s: once it claimed during the outage,
        # its graceful stop waits either for that batch (until the relay sees Kafka gone and
        # gives it back) or for the producer's flush to a broker that is down; either way it
        # is still waiting when the second signal comes, which must cut it short.
        await _produce_until(p, lambda: len(b.matching(claimed)) > before_b)
        b.signal()
        await b.line("stopping: finishing in-flight batches", within=10)
        # Without the abort, B would wait up to its 30 s shutdown_timeout: 20 s is generous for
        # an abort and still short of that.
        code_b, took_b = await b.terminate(within=20)
    FIGURES.notes["13: exit code on SIGTERM with Kafka down"] = code_a
    FIGURES.notes["13: seconds to exit (shutdown_timeout 5)"] = round(took_a, 2)
    FIGURES.notes["10: seconds to abort on a second signal"] = round(took_b, 2)
    # Exit 3 exactly when the graceful stop ran out of time: batches still in flight, or a
    # Kafka producer that could not be closed (its broker is down); 0 otherwise.
    out_a = a.output()
    ran_out = "did not finish within shutdown_timeout" in out_a or "abandoning it" in out_a
    assert code_a == (3 if ran_out else 0), out_a
    assert code_b == 130, b.output()
    marked_in_outage = await fetchval(
        db_dsn, "SELECT count(*) FROM outbox WHERE published_at > $1", down_at
    )
    assert marked_in_outage == 0, "rows were marked published while Kafka was down"
    await run_blocking(kafka.start)
    async with relays(FaultRelay(db_dsn, services.bootstrap, env=KEEP)) as (relay,):
        report = await checker.drain_and_check(within=90)
        await relay.stop_ok()
    print(report.text())
    report.assert_ok()
