"""Delivery without infrastructure faults, checked with the invariant checker.

Scenarios (reliability.md): 1 rollback after the trigger fired, 2 notifications never arrive
(trigger disabled; poll-only), 4 backlog at start while writers insert, 16 late commit, 17 many
rows in one transaction, 35 a key's rows on two topics.
"""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import asyncpg
import pytest

from devstack._common import free_ports
from notify_outbox import OutboxSettings, Relay
from tests.conftest import Services
from tests.faults.checker import OutboxChecker
from tests.faults.harness import (
    FaultRelay,
    KafkaTail,
    connect,
    eventually,
    listener_count,
    relays,
    task_group,
)
from tests.support import create_topics, metric

pytestmark = pytest.mark.anyio


async def test_01_rolled_back_events_are_never_published(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Writers roll back about a third of their transactions after the trigger fired (and some
    roll back a savepoint holding an event inside a committed transaction): none of those
    events reaches Kafka, every committed one does, once, in order."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "1 rollback").setup()
    load = checker.writers(
        writers=3, keys=10, rollback_ratio=0.35, savepoint_ratio=0.2, max_events=150
    )
    async with relays(FaultRelay(db_dsn, services.bootstrap)) as (relay,):
        await relay.ready()
        await load.run()
        report = await checker.drain_and_check(within=60)
        await relay.stop_ok()
    print(report.text())
    assert checker.ledger.count("rolled_back") > 100, "the scenario rolled back too little"
    assert report.duplicates == 0
    report.assert_ok()


async def test_35_a_keys_rows_on_two_topics_arrive_in_commit_order(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Writers send each key's events to two topics at random, some rolled back: every
    committed event arrives once, in commit order per key within each topic, and across the
    two (a key's row for the other topic is sent only once the row before it was
    acknowledged: the checker compares the records' CreateTime). Every key has rows on both
    topics, so the check across topics runs on what the relay sent."""
    other = f"{topic}-other"
    await create_topics(services.bootstrap, [other], partitions=3)
    checker = await OutboxChecker(
        db_dsn, services.bootstrap, [topic, other], "35 two topics"
    ).setup()
    keys = 10
    load = checker.writers(
        writers=3, keys=keys, rollback_ratio=0.1, max_events=200, other_topic=other
    )
    async with relays(FaultRelay(db_dsn, services.bootstrap)) as (relay,):
        await relay.ready()
        await load.run()
        report = await checker.drain_and_check(within=60)
        await relay.stop_ok()
    print(report.text())
    assert report.keys_across_topics == keys, "not every key had rows on both topics"
    assert report.duplicates == 0
    report.assert_ok()


@pytest.mark.parametrize("how", ["trigger disabled", "poll only"])
async def test_02_fallback_poll_delivers_when_notifications_never_arrive(
    db_dsn: str, services: Services, topic: str, how: str
) -> None:
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], f"2 {how}").setup()
    env = {"NOTIFY_OUTBOX_POLL_INTERVAL": "0.3"}
    if how == "trigger disabled":
        async with connect(db_dsn) as conn:
            await conn.execute("ALTER TABLE outbox DISABLE TRIGGER outbox_notify")
    else:
        env["NOTIFY_OUTBOX_POLL_ONLY"] = "true"
    load = checker.writers(writers=2, keys=8, max_events=100)
    async with relays(FaultRelay(db_dsn, services.bootstrap, env=env)) as (relay,):
        await relay.ready()
        if how == "poll only":
            assert await listener_count(db_dsn) == 0, "a poll-only relay must not LISTEN"
        await load.run()
        report = await checker.drain_and_check(within=60)
        await relay.stop_ok()
    print(report.text())
    assert report.duplicates == 0
    report.assert_ok()


async def test_04_backlog_at_start_while_writers_keep_inserting(
    db_dsn: str, services: Services, topic: str
) -> None:
    """A backlog is waiting when the relay starts, twice, with the fallback poll 600 s away:
    only LISTEN plus the catch-up claim that follows it can deliver in time.

    1. The catch-up alone: the writers stop before the relay starts, so no notification
       arrives after its LISTEN to claim the backlog instead. The relay must still deliver
       all of it, and its own counters show no wake-up but its start.
    2. Writers insert all through the next relay's start-up: nothing may be missed, which
       needs the LISTEN committed before that claim. Writers that keep committing would
       hide a row the claim missed (the next notification's claim sweeps it up), so the
       order itself is checked: the relay stops itself at its first claim
       (``NOTIFY_OUTBOX_TEST_STOP_AT``), and pg_stat_activity shows its listener's LISTEN
       completed, outside any transaction, before that claim's transaction began."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "4 backlog").setup()
    env = {"NOTIFY_OUTBOX_POLL_INTERVAL": "600"}
    async with checker.producer() as p:
        for chunk in range(10):
            await p.bulk([f"key-{(chunk * 7 + i) % 25}" for i in range(200)])
    load = checker.writers(writers=3, keys=25, pause=0.01)
    async with task_group() as tg:
        tg.start_soon(load.run)
        await eventually(
            lambda: _at_least(load.produced, 30), within=30, what="writers are running"
        )
        await load.halt()
    port = free_ports(1)[0]
    first = FaultRelay(
        db_dsn, services.bootstrap, env={**env, "NOTIFY_OUTBOX_HTTP_PORT": str(port)}
    )
    async with relays(first):
        await first.ready()
        report = await checker.drain_and_check(within=60)
        wakeups = {
            source: await anyio.to_thread.run_sync(
                lambda: metric(port, "notify_outbox_wakeups_total", source=source)  # noqa: B023
            )
            for source in ("start", "notification", "poll", "reconnect")
        }
        await first.stop_ok()
    print(report.text())
    print(f"wake-ups of the first relay: {wakeups}")
    assert wakeups == {"start": 1, "notification": 0, "poll": 0, "reconnect": 0}, wakeups
    assert report.committed > 2000  # the bulk backlog and some of the writers
    assert report.duplicates == 0
    report.assert_ok()

    load = checker.writers(writers=3, keys=25, pause=0.01, seed=1)
    async with task_group() as tg:
        tg.start_soon(load.run)
        await eventually(
            lambda: _at_least(load.produced, 30), within=30, what="writers are running"
        )
        stop_at = {**env, "NOTIFY_OUTBOX_TEST_STOP_AT": "after_claim"}
        async with (
            relays(FaultRelay(db_dsn, services.bootstrap, env=stop_at)) as (relay,),
            connect(db_dsn) as watch,
        ):
            await eventually(
                lambda: _frozen(relay.proc.pid), within=60, what="the relay stopped in a claim"
            )
            order = await _listen_before_claim(watch)
            relay.signal(signal.SIGCONT)
            print(f"LISTEN, then the first claim: {order}")
            assert order["listen_state"] == "idle", order  # committed: no transaction open
            assert order["listened_first"], order
            await relay.ready()
            at_ready = load.produced
            await eventually(
                lambda: _at_least(load.produced, at_ready + 200),
                within=60,
                what="200 more events were written after the relay started",
            )
            # Rolled-back attempts count in ``produced``: go on until the run holds more
            # than 2300 commits, as asserted below (a fast start-up leaves fewer).
            await eventually(
                lambda: _at_least(checker.ledger.count("committed"), 2301),
                within=60,
                what="more than 2300 events committed",
            )
            await load.halt()
            report = await checker.drain_and_check(within=60)
            await relay.stop_ok()
    print(report.text())
    assert report.committed > 2300
    assert report.duplicates == 0
    report.assert_ok()


async def _at_least(value: int, target: int) -> bool:
    return value >= target


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): state T in /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


async def _frozen(pid: int) -> bool:
    return _stopped(pid)


# The relay's listener and its workers' open claims, the relay being stopped in one: when the
# listener's LISTEN completed (its last statement then; or its health probe's NOTIFY, run after
# the LISTEN, whose start bounds it) against when the earliest claim's transaction began.
_LISTEN_BEFORE_CLAIM = """
SELECT l.query AS listen_query, l.state AS listen_state,
       CASE WHEN l.query ILIKE 'LISTEN %' THEN l.state_change ELSE l.query_start END
           <= min(w.xact_start) AS listened_first,
       CASE WHEN l.query ILIKE 'LISTEN %' THEN l.state_change ELSE l.query_start END
           AS listened, min(w.xact_start) AS first_claim_began, count(w.pid) AS claims
FROM pg_stat_activity l
JOIN pg_stat_activity w ON w.datname = l.datname AND w.xact_start IS NOT NULL
     AND w.application_name LIKE 'notify-outbox-worker%'
WHERE l.datname = current_database() AND l.application_name = 'notify-outbox-listener'
GROUP BY l.pid, l.query, l.state, l.state_change, l.query_start
"""


async def _listen_before_claim(watch: asyncpg.Connection) -> dict[str, object]:
    rows = await watch.fetch(_LISTEN_BEFORE_CLAIM)
    assert len(rows) == 1, f"one listener beside the claims: {[dict(r) for r in rows]}"
    (row,) = rows
    query = str(row["listen_query"])
    assert query.upper().startswith("LISTEN ") or "pg_notify" in query, (
        f"the listener's last statement is neither its LISTEN nor its probe after it: {query!r}"
    )
    return dict(row)


async def test_16_late_commit_is_not_skipped(db_dsn: str, services: Services, topic: str) -> None:
    """A transaction takes a lower id and commits after one with a higher id.
    Different keys: the early-id row is published when it commits (nothing skipped).
    Same key: the ordering trigger makes the second writer wait for the first, so ids follow
    commit order; if the first rolls back, the second goes on alone."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "16 late commit").setup()
    async with (
        relays(FaultRelay(db_dsn, services.bootstrap)) as (relay,),
        KafkaTail(services.bootstrap, [topic]) as tail,
        checker.producer() as first,
        checker.producer() as second,
        connect(db_dsn) as watch,
    ):
        await relay.ready()
        # Different keys.
        late = await first.begin("key-a")
        early = await second.produce("key-b")
        await tail.wait_for([early], within=30, what="the later-id row of key-b")
        assert late.event_id not in tail.first_seen
        await late.commit()
        await tail.wait_for([late.event_id], within=30, what="the late-committed row of key-a")

        # Same key, the first commits.
        for outcome in ("commit", "rollback"):
            held = await first.begin("key-k")
            waiting_pid = second.conn.get_server_pid()  # type: ignore[union-attr]
            async with task_group() as tg:
                results: list[str] = []

                async def blocked() -> None:
                    results.append(await second.produce("key-k"))  # noqa: B023

                tg.start_soon(blocked)
                await eventually(
                    lambda: _waits_on_advisory_lock(watch, waiting_pid),  # noqa: B023
                    within=10,
                    what="the second same-key writer waits for the first",
                )
                await (held.commit() if outcome == "commit" else held.rollback())
            expect = [results[0]] + ([held.event_id] if outcome == "commit" else [])
            await tail.wait_for(expect, within=30, what=f"same-key rows after {outcome}")
        report = await checker.drain_and_check(within=60)
        await relay.stop_ok()
    print(report.text())
    assert report.duplicates == 0
    report.assert_ok()


async def _waits_on_advisory_lock(conn: object, pid: int) -> bool:
    row = await conn.fetchrow(  # type: ignore[attr-defined]
        "SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = $1", pid
    )
    return row is not None and (row["wait_event_type"], row["wait_event"]) == ("Lock", "advisory")


async def test_17_many_rows_in_one_transaction_are_all_published(
    db_dsn: str, services: Services, topic: str
) -> None:
    """5000 rows in one INSERT and 500 rows in 500 INSERTs of one transaction: each
    transaction's NOTIFYs fold into one wake-up, and still every row is published, once,
    in order per key, without the fallback poll (600 s away: it never runs)."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "17 one big tx").setup()
    settings = OutboxSettings.model_validate(
        {
            "dsn": db_dsn,
            "kafka_bootstrap_servers": services.bootstrap,
            "workers": 3,
            "poll_interval": 600.0,  # the folded notification must be enough
        }
    )
    async with Relay(settings) as relay, checker.producer() as p:
        keys: list[str | None] = [f"key-{i % 40}" for i in range(5000)]
        keys[::50] = [None] * len(keys[::50])
        await p.bulk(keys)
        await p.many([f"key-{i % 13}" for i in range(500)])
        report = await checker.drain_and_check(within=90)
        counts = dict(relay.events.counts)
        notifications = counts.get("wake:notification", 0)
    print(report.text())
    print(f"relay events: {counts}")
    # The relay's own account: no fallback poll ran, none woke a worker.
    assert counts.get("poll", 0) == 0, counts
    assert counts.get("wake:poll", 0) == 0, counts
    # At most one wake-up per transaction: the NOTIFYs of one transaction fold into one (and
    # with the gated notify a producer may skip it while the relay is awake).
    assert notifications <= 2, f"{notifications} notifications for two transactions"
    assert report.committed == 5500
    assert report.duplicates == 0
    report.assert_ok()
