"""The relay dies or is stopped in the middle of a batch.

Scenarios (reliability.md): 8 ``kill -9`` after the Kafka ack, before the mark; 9 ``kill -9``
after the claim, before the send, and a live relay's rows are never stolen; 10 SIGTERM
mid-batch; 11 the host cancels the embedded relay mid-batch.

The crashes use the CLI's test hook ``NOTIFY_OUTBOX_TEST_CRASH_AT``: the relay SIGKILLs itself
the first time a batch reaches that point, with one worker, so exactly one batch is in flight.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from notify_outbox import OutboxSettings, Relay
from notify_outbox.core.outbox import OutboxRow
from notify_outbox.kafka.publisher import KafkaPublisher, PublishResult
from tests.conftest import Services
from tests.faults.checker import FIGURES, OutboxChecker
from tests.faults.harness import (
    FaultRelay,
    KafkaTail,
    connect,
    eventually,
    relays,
)
from tests.support import consume, header

pytestmark = pytest.mark.anyio

KEEP = {"NOTIFY_OUTBOX_KEEP_PUBLISHED": "3600"}  # keep marked rows, to compare with Kafka


async def _backlog(checker: OutboxChecker, transactions: int, keys: int) -> None:
    async with checker.producer() as p:
        for t in range(transactions):
            await p.bulk([f"key-{(t * 200 + i) % keys}" for i in range(200)])


async def _in_kafka(bootstrap: str, topic: str) -> set[str]:
    """Every event id in the topic now (reads to the end offsets, no waiting for more)."""
    records, total = await consume(bootstrap, topic, expect=0, within=30)
    if len(records) < total:
        records, _ = await consume(bootstrap, topic, expect=total, within=30)
    return {header(r, "outbox-event-id") or "" for r in records}


async def _marked(dsn: str) -> set[str]:
    async with connect(dsn) as conn:
        rows = await conn.fetch("SELECT event_id FROM outbox WHERE published_at IS NOT NULL")
    return {str(r["event_id"]) for r in rows}


async def _all_claimable(dsn: str, total: int) -> bool:
    """Whether every pending row can be locked now (the dead relay's locks are gone)."""
    async with connect(dsn) as conn, conn.transaction():
        n = await conn.fetchval(
            "SELECT count(*) FROM (SELECT id FROM outbox WHERE published_at IS NULL "
            "FOR UPDATE SKIP LOCKED) AS free"
        )
    return int(n) == total


@pytest.mark.parametrize("point", ["after_claim", "after_ack", "after_mark"])
async def test_08_09_kill_at_each_step_of_a_batch(
    db_dsn: str, services: Services, topic: str, point: str
) -> None:
    """SIGKILL at one step of the first batch, then a restart. Exactly the in-flight batch
    may repeat, and only if Kafka had acknowledged it before the mark:
    after_claim: nothing was sent, the rows are claimable again, no duplicate;
    after_ack: the batch is in Kafka but unmarked, and is sent again: exactly those repeat;
    after_mark: the batch is marked, nothing repeats."""
    scenario = {"after_claim": "9", "after_ack": "8", "after_mark": "8"}[point]
    checker = await OutboxChecker(
        db_dsn, services.bootstrap, [topic], f"{scenario} kill -9 {point}"
    ).setup()
    await _backlog(checker, transactions=3, keys=30)
    total = 600
    env = {**KEEP, "NOTIFY_OUTBOX_WORKERS": "1", "NOTIFY_OUTBOX_TEST_CRASH_AT": point}
    async with relays(
        FaultRelay(db_dsn, services.bootstrap, "--log-level", "DEBUG", env=env, name="crashing")
    ) as (crashing,):
        code = await crashing.exited(60)
        crashed_at = time.monotonic()
        assert code == -signal.SIGKILL, crashing.output()
        claims = crashing.matching(r"claimed \d+ rows")
    assert len(claims) == 1, claims
    batch = int(claims[0].split("claimed ")[1].split()[0])
    sent = await _in_kafka(services.bootstrap, topic)
    marked = await _marked(db_dsn)
    expect_sent = 0 if point == "after_claim" else batch
    assert len(sent) == expect_sent, f"{len(sent)} in Kafka after a crash {point} of {batch}"
    assert len(marked) == (batch if point == "after_mark" else 0)
    if point == "after_mark":
        assert marked == sent
    # The dead relay's row locks die with its connection: all pending rows are free again.
    await eventually(
        lambda: _all_claimable(db_dsn, total - len(marked)),
        within=10,
        what="the crashed relay's claimed rows are claimable again",
    )
    if point == "after_ack":
        checker.allow_duplicate_ids(sent, f"relay crash {point}: the batch in flight")
    async with (
        relays(FaultRelay(db_dsn, services.bootstrap, env=KEEP)) as (relay,),
        KafkaTail(services.bootstrap, [topic]) as tail,
        checker.producer() as p,
    ):
        marker = await p.produce("marker")
        arrived = await tail.wait_for([marker], within=60, what="an event after the crash")
        FIGURES.recovery("relay crash (restart, drain 600)", arrived - crashed_at)
        report = await checker.drain_and_check(within=60)
        await relay.stop_ok()
    print(report.text())
    assert set(report.duplicate_ids) == (sent if point == "after_ack" else set())
    report.assert_ok()


class HeldPublisher:
    """A ``Publisher`` around the real Kafka one that holds its first batch, before or after
    the real send, until released: a batch frozen in flight at a known point."""

    def __init__(self, inner: KafkaPublisher, *, after_send: bool) -> None:
        self.inner = inner
        self.after_send = after_send
        self.held: list[OutboxRow] = []
        self.reached = anyio.Event()
        self.release = anyio.Event()

    async def publish(self, rows: Sequence[OutboxRow]) -> PublishResult:
        if self.reached.is_set():
            return await self.inner.publish(rows)
        self.held = list(rows)
        result = await self.inner.publish(rows) if self.after_send else None
        self.reached.set()
        await self.release.wait()
        return result if result is not None else await self.inner.publish(rows)

    @property
    def available(self) -> bool:
        return self.inner.available

    async def wait_available(self) -> None:
        await self.inner.wait_available()

    async def check(self) -> bool:
        return await self.inner.check()


def _settings(db_dsn: str, services: Services, **kw: Any) -> OutboxSettings:
    base: dict[str, Any] = {
        "dsn": db_dsn,
        "kafka_bootstrap_servers": services.bootstrap,
        "workers": 1,
        "batch_size": 5,
        "poll_interval": 30.0,
        "keep_published": 3600.0,
    }
    return OutboxSettings.model_validate({**base, **kw})


async def test_09_rows_claimed_by_a_live_relay_are_never_stolen(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Relay A (embedded) claims a batch and is stuck before sending it. Relay B (a process)
    runs meanwhile with new events on every key: B delivers every other key, but never one of
    A's rows, nor any later row of a key A holds. Released, A sends its batch, and every key
    arrives in order, once."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "9 never stolen").setup()
    await _backlog(checker, transactions=1, keys=20)
    settings = _settings(db_dsn, services)
    kafka = KafkaPublisher(settings)
    await kafka.start()
    held = HeldPublisher(kafka, after_send=False)
    try:
        async with (
            Relay(settings, publisher=held),
            KafkaTail(services.bootstrap, [topic]) as tail,
            checker.producer() as p,
        ):
            with anyio.fail_after(30):
                await held.reached.wait()
            held_keys = {r.key for r in held.held}
            assert 0 < len(held_keys) < 20
            async with relays(FaultRelay(db_dsn, services.bootstrap, name="B")) as (b,):
                await b.ready()
                later = {f"key-{i % 20}": await p.produce(f"key-{i % 20}") for i in range(40)}
                free = [e for k, e in later.items() if k not in held_keys]
                await tail.wait_for(free, within=60, what="B delivers the keys A does not hold")
                async with connect(db_dsn) as conn:
                    held_key_ids = {
                        str(r["event_id"])
                        for r in await conn.fetch(
                            "SELECT event_id FROM fault_commits WHERE key = ANY($1)",
                            list(held_keys),
                        )
                    }
                stolen = held_key_ids & tail.first_seen.keys()
                assert not stolen, f"B published {len(stolen)} rows of keys A holds"
                held.release.set()
                report = await checker.drain_and_check(within=60)
                await b.stop_ok()
    finally:
        await kafka.stop(10)
    print(report.text())
    assert report.duplicates == 0
    report.assert_ok()


async def test_10_sigterm_mid_batch_publishes_and_marks_it_then_exits_zero(
    db_dsn: str, services: Services, topic: str
) -> None:
    """SIGTERM while batches are in flight: they are published and marked, the process exits
    0 within the shutdown timeout, nothing published is left unmarked, and a restart sends
    the rest with no duplicate."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "10 SIGTERM").setup()
    await _backlog(checker, transactions=30, keys=50)
    total, shutdown = 6000, 15.0
    env = {**KEEP, "NOTIFY_OUTBOX_BATCH_SIZE": "200", "NOTIFY_OUTBOX_SHUTDOWN_TIMEOUT": "15"}
    async with relays(FaultRelay(db_dsn, services.bootstrap, "--log-level", "DEBUG", env=env)) as (
        relay,
    ):
        await relay.line(r"claimed \d+ rows", within=60)
        code, took = await relay.terminate(within=60)
        assert code == 0, relay.output()
        assert took <= shutdown, f"graceful stop took {took:.1f}s"
    marked = await _marked(db_dsn)
    assert 0 < len(marked) < total, "the stop came mid-stream"
    sent = await _in_kafka(services.bootstrap, topic)
    assert sent == marked, (
        f"published but unmarked: {len(sent - marked)}; marked but not published: "
        f"{len(marked - sent)}"
    )
    async with relays(FaultRelay(db_dsn, services.bootstrap, env=env)) as (relay,):
        report = await checker.drain_and_check(within=90)
        await relay.stop_ok()
    print(report.text())
    assert report.duplicates == 0
    report.assert_ok()


async def test_11_host_cancels_the_embedded_relay_mid_batch(
    db_dsn: str, services: Services, topic: str
) -> None:
    """The host application cancels the task running the relay while a batch is acked by
    Kafka but not yet marked: the task ends promptly, the batch is not half-marked (all of it
    stays pending, and is sent again later: exactly those events repeat), no connection is
    left behind, and the host's signal handlers are as they were."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "11 host cancel").setup()
    await _backlog(checker, transactions=1, keys=20)
    loop = asyncio.get_running_loop()
    host_handler = loop.get_exception_handler()
    asyncpg_noise: list[str] = []

    def tolerate_asyncpg_cancel_noise(lp: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
        # Cancelling a running query makes asyncpg send a cancel request on a connection of
        # its own, whose future can end with this error that nobody retrieves (asyncpg's
        # doing, logged by asyncio; the relay cannot reach it). Anything else still fails.
        error = ctx.get("exception")
        if isinstance(error, ConnectionError) and "unexpected connection_lost" in str(error):
            asyncpg_noise.append(str(error))
            return
        if host_handler is not None:
            host_handler(lp, ctx)
        else:
            lp.default_exception_handler(ctx)

    loop.set_exception_handler(tolerate_asyncpg_cancel_noise)
    usr1 = anyio.Event()
    loop.add_signal_handler(signal.SIGUSR1, usr1.set)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)}
    settings = _settings(db_dsn, services, batch_size=50)
    kafka = KafkaPublisher(settings)
    await kafka.start()
    held = HeldPublisher(kafka, after_send=True)
    relay = Relay(settings, publisher=held)
    try:
        task = asyncio.create_task(relay.run())
        with anyio.fail_after(30):
            await held.reached.wait()
        held_ids = {str(r.event_id) for r in held.held}
        started = time.monotonic()
        task.cancel()
        # A generous deadline (load slows any process down): a relay that does not honour the
        # cancellation waits for acks that never come, for good. The time taken is a figure.
        with anyio.fail_after(30), pytest.raises(asyncio.CancelledError):
            await task
        took = time.monotonic() - started
    finally:
        await kafka.stop(10)
    FIGURES.notes["11: seconds for the cancelled relay to end"] = round(took, 2)
    async with connect(db_dsn) as conn:
        half = await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL AND event_id = ANY($1)",
            list(held_ids),
        )

        # The relay closed its connections; their server processes end a moment later.
        async def none_left() -> bool:
            left = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE application_name LIKE 'notify-outbox%' AND datname = current_database()"
            )
            return bool(left == 0)

        await eventually(none_left, within=30, what="no relay connection is left behind")
    assert half == 0, f"{half} of the cancelled batch's {len(held_ids)} rows were marked"
    assert {s: signal.getsignal(s) for s in before} == before
    signal.raise_signal(signal.SIGUSR1)
    with anyio.fail_after(5):
        await usr1.wait()  # the host's own loop handler still works
    loop.remove_signal_handler(signal.SIGUSR1)
    loop.set_exception_handler(host_handler)
    FIGURES.notes["11: asyncpg cancel-request futures left unretrieved"] = len(asyncpg_noise)
    checker.allow_duplicate_ids(held_ids, "host cancelled after the ack: the batch in flight")
    async with Relay(_settings(db_dsn, services, batch_size=50)):
        report = await checker.drain_and_check(within=60)
    print(report.text())
    assert set(report.duplicate_ids) == held_ids
    report.assert_ok()
