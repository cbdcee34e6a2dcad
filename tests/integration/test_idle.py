"""An idle relay stays idle (issue #10, "no busy loops"), against the real SQL: rows waiting
for their retry time, and a producer transaction left open while the relay is awake."""

from __future__ import annotations

import time

import anyio
import asyncpg
import pytest

from notify_outbox import OutboxNames, OutboxSettings, Relay
from tests.conftest import Services
from tests.support import consume

pytestmark = pytest.mark.anyio

INSERT = "INSERT INTO outbox (topic, key, payload) VALUES ($1, $2, '{}')"


async def test_rows_waiting_for_their_retry_keep_the_relay_idle(
    db_dsn: str, services: Services, topic: str
) -> None:
    """A key's first row fails (its topic does not exist) and waits an hour for its retry; the
    key's later row must wait behind it. Neither is due: fallback polls come and go, and the
    relay claims nothing, while other keys are delivered."""
    settings = OutboxSettings(
        dsn=db_dsn,
        kafka_bootstrap_servers=services.bootstrap,
        workers=2,
        poll_interval=0.05,
        retry_base_delay=3600,
        retry_max_delay=3600,
    )
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(INSERT, "no-such-topic-" + topic, "k")
        await conn.execute(INSERT, topic, "k")
        await conn.execute(INSERT, topic, "other")
        behind = await conn.fetchval("SELECT max(id) FROM outbox WHERE key = 'k'")
        async with Relay(settings) as relay:
            events = relay.events
            with anyio.fail_after(30):
                await events.wait_for("retried")
                await events.wait_for("published")
                # The key's later row is fresh until a claim parks it behind the failed one
                # (migration 0006): until then a poll rightly finds work.
                while not await conn.fetchval(
                    "SELECT next_attempt_at = 'infinity' FROM outbox WHERE id = $1", behind
                ):
                    await events.wait_for("claimed_none", events.counts["claimed_none"] + 1)
                # A poll already in flight may have looked before that park and may still
                # wake a worker: let it finish first. Polls run one after the other, and
                # each counts "poll" before it looks: once two more have started, the one in
                # flight has ended.
                await events.wait_for("poll", events.counts["poll"] + 2)
            # From here on nothing is due. (Before, a poll may find the rows still pending
            # while the first claim waits for Kafka to refuse the missing topic: not idle yet.)
            claimed, batches = events.counts["claimed"], events.counts["batch_done"]
            woken = events.counts["wake:poll"]
            with anyio.fail_after(30):
                await events.wait_for("poll", events.counts["poll"] + 40)
            assert events.counts["claimed"] == claimed
            assert events.counts["batch_done"] == batches
            assert events.counts["wake:poll"] == woken
            pending = await conn.fetch("SELECT key, attempts FROM outbox ORDER BY id")
        assert [tuple(r) for r in pending] == [("k", 1), ("k", 0)]
        records, _ = await consume(services.bootstrap, topic, expect=1, within=30)
        assert [r.key for r in records] == [b"other"]
    finally:
        await conn.close()


async def test_an_open_producer_transaction_does_not_make_an_awake_relay_spin(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Producers in flight keep the gate held while the relay is awake: the relay cannot go to
    sleep. It retries a few times, then lets producers notify again and watches the gate with
    a growing backoff (no busy loop). A row inserted while it was awake skipped its NOTIFY: once
    every producer is done, the relay finds that row by itself (the fallback poll is an hour
    away)."""
    settings = OutboxSettings(
        dsn=db_dsn,
        kafka_bootstrap_servers=services.bootstrap,
        workers=1,
        poll_interval=3600,
        gate_awake_after=0,  # the first claim marks the relay awake
        gate_awake_rate=0,
        gate_linger=0.002,
        gate_poll_interval=0.02,  # tries for 20+40+...+640 ms before letting go
    )
    gate_key = OutboxNames().gate_key
    holder, producer, other = [await asyncpg.connect(db_dsn) for _ in range(3)]
    try:
        # Epochs long enough that the awake marker outlasts the test: what is tested here is the
        # sleep protocol while producers are in flight, not the marker's lapse (migration 0006;
        # tests/integration/test_gated_notify.py).
        await other.execute("UPDATE outbox_config SET awake_epoch_ms = 60000")
        async with Relay(settings) as relay:
            events = relay.events
            # A producer transaction that stays open holds the gate (as the trigger does).
            hold = holder.transaction()
            await hold.start()
            await holder.execute("SELECT pg_advisory_xact_lock_shared($1)", gate_key)
            # Another producer's commit wakes the relay, which claims and marks itself awake,
            # then cannot go to sleep.
            await other.execute(INSERT, topic, "wake")
            with anyio.fail_after(30):
                await events.wait_for("gate_busy")
            # Still awake: this row skips its NOTIFY, and its transaction holds the gate too.
            late = producer.transaction()
            await late.start()
            await producer.execute(INSERT, topic, "late")
            assert events.counts["gate_sleep"] == 0, "the relay was not awake at the insert"
            notifications = events.counts["wake:notification"]
            with anyio.fail_after(30):
                await events.wait_for("gate_sleep")  # gave up: producers notify again
            busy = events.counts["gate_busy"]
            started = time.monotonic()
            with anyio.fail_after(30):
                await events.wait_for("gate_busy", busy + 8)
            # 8 watch probes wait at least 10+20+40+...+640+1000 ms (jittered in upper halves).
            assert time.monotonic() - started >= 2.0, "the relay polled the gate in a loop"
            await late.commit()
            assert events.counts["published"] == 1  # the gate is still held: not yet looked
            await hold.commit()  # every producer is done: the watch wakes a worker
            with anyio.fail_after(30):
                await events.wait_for("published", 2)
            assert events.counts["wake:gate"] == 1
            assert events.counts["wake:notification"] == notifications  # the row skipped it
            assert events.counts["wake:poll"] == 0
        records, _ = await consume(services.bootstrap, topic, expect=2, within=30)
        assert sorted(r.key for r in records) == [b"late", b"wake"]
    finally:
        for conn in (holder, producer, other):
            await conn.close()
