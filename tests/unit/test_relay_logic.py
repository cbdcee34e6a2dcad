"""The relay's logic against in-memory fakes: drain, order, retry, dead-letter, outage and
shutdown behaviour, in milliseconds."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import asyncpg
import pytest

from notify_outbox import OutboxSettings, Relay
from notify_outbox.core.outbox import ClaimedBatch, OutboxRow
from notify_outbox.relay.stalls import AUTO_CEILING, AUTO_FLOOR, WARMUP
from tests.fakes import FakePublisher, FakeStore, fake_settings
from tests.faults.harness import eventually

pytestmark = pytest.mark.anyio


def settings(**kw: object) -> OutboxSettings:
    return fake_settings(**kw)


async def wait_drained(store: FakeStore, relay: Relay) -> None:
    with anyio.fail_after(10):
        while store.pending():
            await relay.events.wait_for("batch_done", relay.events.counts["batch_done"] + 1)


async def test_drains_backlog_once_and_keeps_key_order() -> None:
    store, pub = FakeStore(), FakePublisher()
    for i in range(1000):
        store.add(key=f"k{i % 10}")
    async with Relay(settings(workers=3, batch_size=50), store=store, publisher=pub) as relay:
        await wait_drained(store, relay)
    assert relay.outcome == "stopped"
    ids = [r.id for r in pub.sent]
    assert sorted(ids) == list(range(1, 1001))  # all, and each exactly once
    per_key: dict[str | None, list[int]] = defaultdict(list)
    for row in pub.sent:
        per_key[row.key].append(row.id)
    assert all(v == sorted(v) for v in per_key.values())
    # A full batch wakes a sibling: more than one worker drained the backlog.
    assert relay.events.counts["wake:backlog"] > 0


async def test_failing_row_is_retried_then_dead_lettered_and_its_key_continues() -> None:
    store = FakeStore()
    poison = store.add(key="p")
    after = store.add(key="p")
    other = store.add(key="q")
    pub = FakePublisher(lambda row: ("fail", "topic missing") if row.id == poison else None)
    async with Relay(settings(max_attempts=3), store=store, publisher=pub) as relay:
        await wait_drained(store, relay)
    assert store.rows[poison].dead is not None
    assert "after 3 attempts" in store.rows[poison].dead
    assert store.rows[poison].errors == ["topic missing", "topic missing"]
    # The later row of the poison key waited behind it, then went out; other keys never waited.
    assert [r.id for r in pub.sent] == [other, after]
    assert relay.events.counts["dead_lettered"] == 1
    assert relay.events.counts["retried"] == 2


async def test_rejected_row_is_dead_lettered_at_once() -> None:
    store = FakeStore()
    bad = store.add(key="k")
    pub = FakePublisher(lambda row: ("reject", "malformed headers") if row.id == bad else None)
    async with Relay(settings(max_attempts=10), store=store, publisher=pub) as relay:
        await wait_drained(store, relay)
    assert store.rows[bad].dead == "malformed headers"
    assert store.rows[bad].errors == []


async def test_kafka_outage_marks_nothing_and_recovers() -> None:
    store = FakeStore()
    for i in range(20):
        store.add(key=f"k{i % 3}")
    down = {"calls": 3}

    def behaviour(_row: object) -> tuple[str, str] | None:
        return ("unavailable", "broker down") if down["calls"] > 0 else None

    pub = FakePublisher(behaviour)
    original = pub.publish

    async def publish(rows):  # type: ignore[no-untyped-def]
        result = await original(rows)
        down["calls"] -= 1
        assert not result.delivered or down["calls"] < 0
        return result

    pub.publish = publish  # type: ignore[method-assign]
    async with Relay(settings(), store=store, publisher=pub) as relay:
        await wait_drained(store, relay)
    assert relay.events.counts["kafka_unavailable"] == 3
    assert pub.available_calls == 3
    assert all(r.published for r in store.rows.values())
    assert [r.id for r in pub.sent] == sorted(r.id for r in pub.sent)


async def test_graceful_stop_finishes_the_in_flight_batch() -> None:
    store, pub = FakeStore(), FakePublisher()
    for _ in range(5):
        store.add(key="k")
    pub.gate = anyio.Event()
    relay = Relay(settings(), store=store, publisher=pub)
    task = asyncio.create_task(relay.run())
    await pub.entered.wait()
    relay.request_stop()
    pub.gate.set()
    await task
    assert relay.outcome == "stopped"
    assert all(r.published for r in store.rows.values())
    assert store.claims == 1  # no claim after the stop request


async def test_shutdown_timeout_aborts_a_stuck_batch_and_keeps_rows_pending() -> None:
    store, pub = FakeStore(), FakePublisher()
    store.add(key="k")
    pub.gate = anyio.Event()  # never set: Kafka never answers
    relay = Relay(settings(shutdown_timeout=0.2), store=store, publisher=pub)
    task = asyncio.create_task(relay.run())
    await pub.entered.wait()
    relay.request_stop()
    with anyio.fail_after(30):  # a generous deadline on the exit: load slows any process
        await task
    assert relay.outcome == "forced"
    assert len(store.pending()) == 1
    assert not store.locked


async def test_cancelling_the_embedded_relay_rolls_back_the_batch() -> None:
    store, pub = FakeStore(), FakePublisher()
    store.add(key="k")
    pub.gate = anyio.Event()
    task = asyncio.create_task(Relay(settings(), store=store, publisher=pub).run())
    await pub.entered.wait()
    task.cancel()
    with anyio.fail_after(30), pytest.raises(asyncio.CancelledError):  # generous, as above
        await task
    assert len(store.pending()) == 1
    assert not store.locked


async def test_an_unexpected_error_stops_the_whole_relay() -> None:
    store = FakeStore()
    store.add()

    def explode(_row: object) -> None:
        raise RuntimeError("bug")

    relay = Relay(settings(workers=3), store=store, publisher=FakePublisher(explode))
    with anyio.fail_after(30), pytest.raises(ExceptionGroup) as info:  # generous, as above
        await relay.run()
    assert info.group_contains(RuntimeError, match="bug")
    assert relay.outcome == "failed"
    assert len(store.pending()) == 1


async def test_fallback_poll_wakes_a_worker_for_rows_that_came_without_a_wake_up() -> None:
    store, pub = FakeStore(), FakePublisher()
    async with Relay(settings(poll_interval=0.02), store=store, publisher=pub) as relay:
        await relay.events.wait_for("wake:start")
        store.add(key="k")  # no notification at all
        with anyio.fail_after(5):
            await relay.events.wait_for("published")
    assert relay.events.counts["wake:poll"] >= 1
    assert len(pub.sent) == 1


async def test_an_idle_relay_does_not_claim_for_rows_waiting_for_their_retry() -> None:
    # A key's first row waits for its retry time; its later row may not overtake it. Neither
    # is due, so fallback polls come and go and nothing is claimed (no busy loop).
    store, pub = FakeStore(), FakePublisher()
    first, later = store.add(key="k"), store.add(key="k")
    store.rows[first].next_attempt = 1e9
    async with Relay(settings(poll_interval=0.005), store=store, publisher=pub) as relay:
        with anyio.fail_after(10):
            # The start-up wake has long been served (one claim, which found nothing).
            await relay.events.wait_for("poll", 5)
        claims = store.claims
        with anyio.fail_after(10):
            await relay.events.wait_for("poll", relay.events.counts["poll"] + 50)
        assert store.claims == claims
        assert relay.events.counts["wake:poll"] == 0
    assert pub.sent == []
    assert store.rows[later].published is False


async def test_a_retry_is_claimed_when_it_becomes_due_not_at_the_next_poll() -> None:
    store = FakeStore(clock=time.monotonic)
    failing = store.add(key="k")
    fails = {"left": 2}

    def behaviour(row: object) -> tuple[str, str] | None:
        if fails["left"] > 0:
            fails["left"] -= 1
            return ("fail", "not yet")
        return None

    pub = FakePublisher(behaviour)
    s = settings(poll_interval=60.0, retry_base_delay=0.05, retry_max_delay=0.05)
    async with Relay(s, store=store, publisher=pub) as relay:
        with anyio.fail_after(10):
            await relay.events.wait_for("published")
            while not store.rows[failing].published:
                await relay.events.wait_for("batch_done", relay.events.counts["batch_done"] + 1)
    assert store.rows[failing].errors == ["not yet", "not yet"]
    assert relay.events.counts["wake:retry"] >= 2
    assert relay.events.counts["wake:poll"] == 0


async def test_an_idle_relay_notices_kafka_going_away_and_claims_nothing_meanwhile() -> None:
    """With nothing to send, the relay still asks Kafka now and then whether it answers: the
    outage starts when Kafka goes, and a row committed meanwhile waits, unclaimed, for its
    return (instead of being claimed into a failing send)."""
    store, pub = FakeStore(), FakePublisher()
    async with Relay(settings(kafka_idle_check_interval=0.02), store=store, publisher=pub) as relay:
        with anyio.fail_after(5):
            await relay.events.wait_for("idle")
            pub.answering = False
            await relay.events.wait_for("kafka_unavailable")
        assert relay.kafka_outage.active
        row = store.add(key="k")
        with anyio.fail_after(5):
            await relay.events.wait_for("poll", relay.events.counts["poll"] + 3)
        assert pub.sent == []
        assert store.pending()
        pub.back()
        with anyio.fail_after(5):
            await relay.events.wait_for("kafka_back")
        await wait_drained(store, relay)
    assert [r.id for r in pub.sent] == [row]
    assert not relay.kafka_outage.active


class ReadOnlyStore(FakeStore):
    """A store whose first ``failures`` claims meet a read-only server (a standby, or a
    demoted primary), as PgOutboxStore reports it after ending that session."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    @asynccontextmanager
    async def claim(
        self, limit: int, idle_timeout: float | None = None
    ) -> AsyncIterator[ClaimedBatch]:
        if self.failures:
            self.failures -= 1
            raise asyncpg.ReadOnlySQLTransactionError(
                "cannot execute SELECT FOR UPDATE in a read-only transaction"
            )
        async with super().claim(limit, idle_timeout) as batch:
            yield batch


async def test_a_read_only_server_is_retried_at_the_reconnect_cadence(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Read-only is not a failing statement (30 s backoff) but a server to leave: the worker
    retries as quickly as it reconnects to an unreachable one, and says so once."""
    store, pub = ReadOnlyStore(failures=16), FakePublisher()
    row = store.add(key="k")
    s = settings(workers=1, reconnect_min_delay=0.001, reconnect_max_delay=0.002)
    caplog.set_level(logging.INFO, logger="notify_outbox")
    async with Relay(s, store=store, publisher=pub) as relay:
        # The statement backoff would wait at least 16 s over these 16 failures (doubling
        # from 1 ms, each delay at least half its step); the reconnect one at most 32 ms.
        with anyio.fail_after(5):
            await relay.events.wait_for("published")
    assert [r.id for r in pub.sent] == [row]
    assert relay.events.counts["db_error"] == 16
    lines = [r.getMessage() for r in caplog.records if "read-only" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "read-only server, reconnecting" in lines[0]
    assert any("PostgreSQL available again" in r.getMessage() for r in caplog.records)


class SwitchedDuringAClaimStore(FakeStore):
    """The server turns read-only while the first claim runs, in a transaction begun before
    the switch (as a primed one is): that claim still succeeds, and every later claim meets
    the read-only server until ``after`` of them have failed since the first one ended."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after
        self.started = 0
        self.refused = anyio.Event()  # a claim met the read-only server
        self.first_done = False

    @asynccontextmanager
    async def claim(
        self, limit: int, idle_timeout: float | None = None
    ) -> AsyncIterator[ClaimedBatch]:
        self.started += 1
        if self.started > 1 and self.after:
            if self.first_done:
                self.after -= 1
            self.refused.set()
            raise asyncpg.ReadOnlySQLTransactionError(
                "cannot execute SELECT FOR UPDATE in a read-only transaction"
            )
        first = self.started == 1
        async with super().claim(limit, idle_timeout) as batch:
            yield batch
        if first:
            self.first_done = True


async def test_a_claim_begun_before_a_read_only_outage_does_not_end_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A claim that began before the outage and succeeds during it proves nothing about the
    server now: the outage goes on (no "available again" and a second "read-only" line); the
    first claim begun after it that succeeds ends it."""
    store, pub = SwitchedDuringAClaimStore(after=2), FakePublisher()
    first = store.add(key="a")
    second = store.add(key="b")
    pub.gate = anyio.Event()  # the first claim's rows wait in "Kafka" until a claim failed
    s = settings(workers=2, batch_size=1, reconnect_min_delay=0.001, reconnect_max_delay=0.002)
    caplog.set_level(logging.INFO, logger="notify_outbox")
    async with Relay(s, store=store, publisher=pub) as relay:
        with anyio.fail_after(5):
            await store.refused.wait()
            pub.gate.set()
            while len(pub.sent) < 2:
                await relay.events.wait_for("published", relay.events.counts["published"] + 1)
    assert [r.id for r in pub.sent] == [first, second]
    assert store.after == 0  # claims failed after the first one succeeded
    lines = [r.getMessage() for r in caplog.records]
    assert len([m for m in lines if "read-only" in m]) == 1, lines
    assert len([m for m in lines if "PostgreSQL available again" in m]) == 1, lines


async def test_each_retry_is_claimed_on_its_own_schedule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rows of one batch fail with different retry delays (the jitter): each is claimed when
    # it comes due, not at the next fallback poll (an hour away), and every retry wake-up
    # finds something to claim. (That a timer whose rows were claimed early is cancelled is
    # tested deterministically in test_wakeup.py; here it depends on the timers' grid.)
    jitters = iter([1.0, 0.1, 1.0, 0.5, 1.0, 0.5] + [1.0] * 100)
    monkeypatch.setattr("notify_outbox.relay.relay._jitter", lambda: next(jitters))
    store = FakeStore(clock=time.monotonic)
    rows = [store.add(key=f"k{i}") for i in range(3)]
    fails = dict.fromkeys(rows, 2)

    def behaviour(row: OutboxRow) -> tuple[str, str] | None:
        row_id = row.id
        if fails[row_id] > 0:
            fails[row_id] -= 1
            return ("fail", "not yet")
        return None

    pub = FakePublisher(behaviour)
    s = settings(workers=1, poll_interval=3600.0, retry_base_delay=0.2, retry_max_delay=0.2)
    # What each retry wake-up led to: the next claim's result (one worker, so it is that
    # wake-up's claim). Claims the relay makes after a batch because more was due are not
    # counted.
    after_retry: list[str] = []
    woken = {"retry": False}

    def hook(name: str, amount: int) -> None:
        if name == "wake:retry":
            woken["retry"] = True
        elif name in ("claimed", "claimed_none") and woken["retry"]:
            woken["retry"] = False
            after_retry.append(name)

    async with Relay(s, store=store, publisher=pub) as relay:
        relay.events.add_hook(hook)
        with anyio.fail_after(10):
            while not all(store.rows[r].published for r in rows):
                await relay.events.wait_for("batch_done", relay.events.counts["batch_done"] + 1)
    assert all(store.rows[r].errors == ["not yet", "not yet"] for r in rows)
    assert relay.events.counts["wake:poll"] == 0
    assert after_retry
    assert set(after_retry) == {"claimed"}, after_retry


async def test_a_claim_is_renewed_within_the_idle_timeout_it_was_given() -> None:
    # While Kafka's acks take long, a claim is renewed every quarter of its idle timeout, so
    # that the server does not end a working relay's claim.
    store, pub = FakeStore(), FakePublisher()
    pub.gate = anyio.Event()
    store.add(key="k")
    s = settings(workers=1, claim_idle_timeout=0.04)
    async with Relay(s, store=store, publisher=pub) as relay:
        await pub.entered.wait()

        async def renewed() -> bool:
            return store.batches[0].keepalives >= 5

        await eventually(renewed, within=5, interval=0.005, what="the claim was renewed")
        pub.gate.set()
        await wait_drained(store, relay)
    assert set(store.idle_timeouts) == {0.04}


async def test_auto_claims_start_at_the_ceiling_then_follow_the_loop_watch() -> None:
    store, pub = FakeStore(), FakePublisher()
    store.add(key="k")
    s = settings(workers=1, claim_idle_timeout="auto")
    async with Relay(s, store=store, publisher=pub) as relay:
        await wait_drained(store, relay)

        async def warm() -> bool:
            return len(relay.claim_timeout.loop) >= WARMUP

        await eventually(warm, within=10, what="the relay's loop watch warmed up")
        store.add(key="k")
        await wait_drained(store, relay)
    assert store.idle_timeouts[0] == AUTO_CEILING
    assert AUTO_FLOOR <= (store.idle_timeouts[-1] or 0) < AUTO_CEILING


async def test_claims_that_meet_held_buckets_leave_one_wake_up_after_the_latest() -> None:
    """A claim that meets buckets held by other claims wakes a worker once those must have
    ended (a frozen holder's claim ends at its idle timeout, here 0.2 s). Claims that meet
    them again and again leave one wake-up, after the latest, not one each: under a steady
    load the holders are busy siblings, and a wake-up per claim kept waking workers 20 times
    a second, each into another claim that met them."""
    store, pub = FakeStore(), FakePublisher()
    store.busy = 1
    s = settings(workers=1, poll_interval=0.02, claim_idle_timeout=0.2)
    claimed_at: list[float] = []
    woken_at: list[float] = []

    def hook(name: str, amount: int) -> None:
        if name in ("claimed", "claimed_none"):
            claimed_at.append(time.monotonic())
        elif name == "wake:retry":
            woken_at.append(time.monotonic())

    async with Relay(s, store=store, publisher=pub) as relay:
        relay.events.add_hook(hook)
        # Claims that meet held buckets for 0.6 s (three idle timeouts): a row at a time.
        started = time.monotonic()
        with anyio.fail_after(10):
            while time.monotonic() - started < 0.6:
                store.add(key="k")
                await relay.events.wait_for("batch_done", relay.events.counts["batch_done"] + 1)
            store.busy = 0
            last_busy = claimed_at[-1]
            await relay.events.wait_for("wake:retry")
    assert len(claimed_at) > 5
    # The first wake-up came 0.22 s after the latest claim that met held buckets, not 0.22 s
    # after the first one (which was 0.6 s earlier).
    assert woken_at[0] >= last_busy + 0.2, (woken_at[0] - last_busy, woken_at[0] - started)
