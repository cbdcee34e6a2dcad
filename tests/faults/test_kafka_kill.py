"""Scenario 28: the Kafka broker is killed with SIGKILL mid-stream, then started again.

Every other Kafka fault of the suite is a graceful stop (SIGTERM: the broker flushes its logs,
writes its clean-shutdown marker and hands its partitions off). A crash leaves none of that:
the broker recovers its log segments, its producer-state snapshots (the idempotent producer's
sequence numbers) and its KRaft metadata log from what is on disk, and the relay's producer
loses its connection with requests in flight and no answer. Writers go on throughout.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import Services
from tests.faults.checker import FIGURES, OutboxChecker
from tests.faults.harness import (
    FaultRelay,
    KafkaTail,
    eventually,
    fetchval,
    idle_latency,
    relays,
    restartable,
    run_blocking,
    task_group,
)

pytestmark = pytest.mark.anyio

BACKLOG = 10_000


async def _at_least(get: object, target: int) -> bool:
    return bool(get() >= target)  # type: ignore[operator]


async def test_28_kafka_sigkill_mid_stream(db_dsn: str, services: Services, topic: str) -> None:
    """SIGKILL the broker while the relay drains a backlog and writers add to it, keep the
    writers going while it is dead, then start it on the same data. The broker recovers from
    its unclean shutdown by itself; the relay publishes everything: none lost, none rolled
    back published, each key in commit order, and only the rows in flight at the kill may
    repeat (Kafka may have appended a batch whose ack the dead broker never sent)."""
    _, kafka = restartable(services)
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "28 Kafka SIGKILL").setup()
    # A committed backlog keeps the relay's workers busy without a pause (claim, send, ack,
    # mark, claim again), so the kill finds batches in flight: writers alone leave the relay
    # idle most of the time, and a kill between two batches would test nothing more than 12.
    async with checker.producer() as p:
        for t in range(BACKLOG // 1000):
            await p.bulk([f"key-{(t * 1000 + i) % 20}" for i in range(1000)])
    last_of_backlog = int(await fetchval(db_dsn, "SELECT max(id) FROM outbox"))
    load = checker.writers(writers=3, keys=20, pause=0.01)
    # As in scenario 12: batches queued while the broker is dead outlive the request timeout.
    env = {"NOTIFY_OUTBOX_KAFKA_REQUEST_TIMEOUT_MS": "1500"}
    async with (
        relays(FaultRelay(db_dsn, services.bootstrap, env=env)) as (relay,),
        KafkaTail(services.bootstrap, [topic]) as tail,
        task_group() as tg,
    ):
        await relay.ready()
        tg.start_soon(load.run)
        await eventually(
            lambda: _at_least(lambda: len(tail.first_seen), BACKLOG // 10),
            within=60,
            what="the relay is draining the backlog",
            interval=0.01,
        )
        log_from = kafka.log_path.stat().st_size
        await run_blocking(kafka.kill)
        pending_at_kill = int(
            await fetchval(
                db_dsn,
                "SELECT count(*) FROM outbox WHERE published_at IS NULL AND id <= $1",
                last_of_backlog,
            )
        )
        checker.allow_duplicates(relay.in_flight_bound, "Kafka SIGKILL: acks lost in flight")
        assert not kafka.is_running()
        assert pending_at_kill > 0, "the backlog was drained before the kill: nothing in flight"
        committed = checker.ledger.count("committed")
        await relay.line("Kafka unavailable", within=60)
        # The application keeps committing while the broker is dead (I6).
        await eventually(
            lambda: _at_least(lambda: checker.ledger.count("committed"), committed + 200),
            within=60,
            what="the application keeps committing while Kafka is dead",
        )
        started = time.monotonic()
        # start() returns once the broker answers a metadata request with itself registered:
        # after its log recovery (a crashed broker replays its segments before it serves).
        await run_blocking(kafka.start)
        healed = time.monotonic()
        broker_back = healed - started
        async with checker.producer() as p:
            marker = await p.produce("marker")
            arrived = await tail.wait_for([marker], within=60, what="an event after the restart")
            FIGURES.recovery("Kafka SIGKILL restart", arrived - healed)
            await load.halt()
            await idle_latency(
                db_dsn, lambda: p.produce("idle"), tail, what="after the Kafka SIGKILL"
            )
        report = await checker.drain_and_check(within=90)
        await relay.stop_ok()
    FIGURES.notes["28: seconds for Kafka to serve again after SIGKILL"] = round(broker_back, 2)
    print(report.text())
    print(
        f"killed with {pending_at_kill} rows pending; Kafka served again {broker_back:.1f}s "
        "after its start"
    )
    report.assert_ok()
    # The broker did recover from a crash (no clean-shutdown marker: it replays the unflushed
    # segments of the test's topic), or this would be scenario 12 again.
    with kafka.log_path.open("rb") as f:
        f.seek(log_from)
        log = f.read().decode(errors="replace")
    recovered = [line for line in log.splitlines() if "Recovering unflushed segment" in line]
    print("\n".join(recovered))
    assert any(f"partition={topic}-" in line for line in recovered), "no crash recovery"
