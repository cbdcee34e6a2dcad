"""Exactly-once delivery under crashes and freezes (issue #35), read as its consumers read it:
read_committed, every partition from the beginning. The checker must find 0 duplicates, 0 lost
events and 0 order inversions, with no allowance.

- ``kill -9`` at each point of a batch: after the stamp (nothing sent), with the Kafka
  transaction open (sent, not committed), and between the Kafka commit and the database's
  confirmation (the case the obvious design gets wrong);
- the control: the same crash between the commits, recovered by a relay that does not read
  the markers (as one without a durable record of what it had sent), duplicates the batch,
  and the checker says so;
- a relay frozen (SIGSTOP) with its transaction open, past its lease: another relay fences it
  and settles its batch; resumed, the frozen one finds itself fenced and sends nothing twice.
"""

from __future__ import annotations

import json
import os
import random
import signal
import uuid
from collections.abc import Callable

import anyio
import pytest
from aiokafka import AIOKafkaProducer

from tests.conftest import Services
from tests.faults.checker import OutboxChecker
from tests.faults.eos_batches import check_batches, read_committed_records
from tests.faults.harness import (
    FaultRelay,
    connect,
    create_topics,
    durable_commits,
    eventually,
    relays,
    restartable,
    run_blocking,
    task_group,
)

pytestmark = pytest.mark.anyio


async def _is_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): state T in /proc/<pid>/stat."""
    stat = await anyio.Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def _eos_env(**extra: str) -> dict[str, str]:
    tag = uuid.uuid4().hex[:8]
    return {
        "NOTIFY_OUTBOX_DELIVERY": "exactly-once",
        "NOTIFY_OUTBOX_EOS_LEASE": "2",
        "NOTIFY_OUTBOX_EOS_SLOTS": "4",
        "NOTIFY_OUTBOX_EOS_TRANSACTION_TIMEOUT": "30",
        "NOTIFY_OUTBOX_EOS_MARKER_TOPIC": f"eos-markers-{tag}",
        "NOTIFY_OUTBOX_EOS_TRANSACTIONAL_ID_PREFIX": f"fault-{tag}.",
        "NOTIFY_OUTBOX_KEEP_PUBLISHED": "3600",
        **extra,
    }


async def _exactly_once(checker: OutboxChecker, keys: int = 30) -> None:
    async with connect(checker.dsn) as conn:
        await conn.execute("UPDATE outbox_config SET delivery = 'exactly-once'")
    async with checker.producer() as p:
        for t in range(3):
            await p.bulk([f"key-{(t * 200 + i) % keys}" for i in range(200)])


async def _stamped(dsn: str) -> set[str]:
    async with connect(dsn) as conn:
        rows = await conn.fetch(
            "SELECT o.event_id FROM outbox_eos_stamp AS s JOIN outbox AS o ON o.id = s.id"
        )
    return {str(r["event_id"]) for r in rows}


async def _whole_batches(dsn: str, bootstrap: str, topic: str, env: dict[str, str]) -> None:
    """No torn batch and no aborted read (``eos_batches.py``); call once the relays stopped."""
    batches = await check_batches(dsn, bootstrap, topic, env["NOTIFY_OUTBOX_EOS_MARKER_TOPIC"])
    print(batches.text())
    assert batches.ok, batches.text()


async def _visible(bootstrap: str, topic: str) -> set[str]:
    """Event ids a read_committed consumer sees in ``topic`` now (up to the last stable
    offsets)."""
    return {
        h["outbox-event-id"].decode()
        for h, _ in await read_committed_records(bootstrap, topic)
        if "outbox-event-id" in h
    }


@pytest.mark.parametrize(
    ("point", "committed"),
    [("eos_after_stamp", False), ("eos_before_commit", False), ("eos_after_commit", True)],
)
async def test_kill_at_each_point_of_a_batch_sends_each_event_once(
    db_dsn: str, services: Services, topic: str, point: str, committed: bool
) -> None:
    checker = await OutboxChecker(
        db_dsn,
        services.bootstrap,
        [topic],
        f"exactly-once kill -9 {point}",
        isolation_level="read_committed",
    ).setup()
    await _exactly_once(checker)
    env = _eos_env()
    crash = {**env, "NOTIFY_OUTBOX_WORKERS": "1", "NOTIFY_OUTBOX_TEST_CRASH_AT": point}
    async with relays(FaultRelay(db_dsn, services.bootstrap, env=crash, name="crashing")) as (
        crashing,
    ):
        assert await crashing.exited(60) == -signal.SIGKILL, crashing.output()
    in_flight = await _stamped(db_dsn)
    assert in_flight, "the crash must leave a stamped batch"
    visible = await _visible(services.bootstrap, topic)
    assert visible == (in_flight if committed else set()), (
        f"{len(visible)} of the batch's {len(in_flight)} events visible after a crash {point}"
    )
    async with relays(FaultRelay(db_dsn, services.bootstrap, env=env, name="after")) as (relay,):
        line = await relay.line(r"batch \d+ was in flight", within=60)
        report = await checker.drain_and_check(within=90)
        await relay.stop_ok()
    print(report.text())
    assert ("its transaction committed" in line) == committed, line
    report.assert_ok()
    assert report.duplicate_ids == {}
    assert await _stamped(db_dsn) == set()
    await _whole_batches(db_dsn, services.bootstrap, topic, env)


async def test_the_control_a_recovery_blind_to_the_markers_duplicates_the_batch(
    db_dsn: str, services: Services, topic: str
) -> None:
    """What the stamp and the markers prevent, shown: the same crash between the Kafka commit
    and the database's confirmation, recovered by a relay that cannot tell whether the batch
    committed (it sends it again): the checker finds exactly that batch twice."""
    checker = await OutboxChecker(
        db_dsn,
        services.bootstrap,
        [topic],
        "exactly-once control: recovery without markers",
        isolation_level="read_committed",
    ).setup()
    await _exactly_once(checker)
    env = _eos_env()
    crash = {**env, "NOTIFY_OUTBOX_WORKERS": "1", "NOTIFY_OUTBOX_TEST_CRASH_AT": "eos_after_commit"}
    async with relays(FaultRelay(db_dsn, services.bootstrap, env=crash, name="crashing")) as (
        crashing,
    ):
        assert await crashing.exited(60) == -signal.SIGKILL, crashing.output()
    in_flight = await _stamped(db_dsn)
    blind = {**env, "NOTIFY_OUTBOX_TEST_EOS_IGNORE_MARKERS": "1"}
    async with relays(FaultRelay(db_dsn, services.bootstrap, env=blind, name="blind")) as (relay,):
        # Not recorded among the suite's figures: this check is meant to fail.
        report = await checker.drain_and_check(within=90, record=False)
        await relay.stop_ok()
    print(report.text())
    assert in_flight
    assert set(report.duplicate_ids) == in_flight
    assert not report.ok


async def test_a_relay_frozen_with_its_transaction_open_is_fenced_and_sends_nothing_twice(
    db_dsn: str, services: Services, topic: str
) -> None:
    checker = await OutboxChecker(
        db_dsn,
        services.bootstrap,
        [topic],
        "exactly-once: a relay frozen past its lease, then resumed",
        isolation_level="read_committed",
    ).setup()
    await _exactly_once(checker)
    env = _eos_env()
    freeze = {
        **env,
        "NOTIFY_OUTBOX_WORKERS": "1",
        "NOTIFY_OUTBOX_TEST_STOP_AT": "eos_before_commit",
    }
    frozen = FaultRelay(db_dsn, services.bootstrap, env=freeze, name="frozen")
    async with relays(frozen):
        # It stops itself with a batch sent in an open Kafka transaction.
        await eventually(
            lambda: _is_stopped(frozen.proc.pid), within=60, what="the relay froze mid-batch"
        )
        in_flight = await _stamped(db_dsn)
        assert in_flight
        # Another relay takes its slot once the lease (2 s) expired, fences its producer,
        # finds the batch uncommitted and sends it again.
        async with relays(FaultRelay(db_dsn, services.bootstrap, env=env, name="other")) as (
            other,
        ):
            line = await other.line(r"batch \d+ was in flight", within=60)
            assert "did not commit" in line, line
            frozen.signal(signal.SIGCONT)
            await frozen.line(r"is no longer this relay's", within=60)
            report = await checker.drain_and_check(within=90)
            await frozen.stop_ok()
            await other.stop_ok()
    print(report.text())
    report.assert_ok()
    assert report.duplicate_ids == {}
    await _whole_batches(db_dsn, services.bootstrap, topic, env)


async def _grows(get: Callable[[], int], target: int) -> bool:
    return get() >= target


@pytest.mark.parametrize("service", ["postgres", "kafka"])
async def test_a_service_restart_under_writers_sends_each_event_once(
    db_dsn: str, services: Services, topic: str, service: str
) -> None:
    """PostgreSQL (immediate, like a crash) or the Kafka broker restarts under writers and two
    relays. Every batch in flight at that moment is settled from the markers: none repeats,
    none is lost, with no allowance."""
    postgres, kafka = restartable(services)
    checker = await OutboxChecker(
        db_dsn,
        services.bootstrap,
        [topic],
        f"exactly-once: {service} restart under writers",
        isolation_level="read_committed",
    ).setup()
    await durable_commits(db_dsn)
    async with connect(db_dsn) as conn:
        await conn.execute("UPDATE outbox_config SET delivery = 'exactly-once'")
    if service == "postgres":
        checker.expect_writer_errors()
    load = checker.writers(writers=3, keys=20, pause=0.01)
    env = _eos_env(NOTIFY_OUTBOX_KAFKA_REQUEST_TIMEOUT_MS="1500")
    async with (
        relays(
            FaultRelay(db_dsn, services.bootstrap, env=env, name="relay-a"),
            FaultRelay(db_dsn, services.bootstrap, env=env, name="relay-b"),
        ) as (a, b),
        task_group() as tg,
    ):
        await a.ready()
        await b.ready()
        tg.start_soon(load.run)
        await eventually(
            lambda: _grows(lambda: load.produced, 300), within=60, what="writers produced"
        )
        if service == "postgres":
            await run_blocking(lambda: postgres.stop(mode="immediate"))
            await run_blocking(postgres.start)
        else:
            await run_blocking(kafka.stop)
            await anyio.sleep(2)  # an outage, not a blip: sends and commits fail meanwhile
            await run_blocking(kafka.start)
        target = load.produced + 300
        await eventually(
            lambda: _grows(lambda: load.produced, target),
            within=60,
            what="writers produced after the restart",
        )
        await load.halt()
        report = await checker.drain_and_check(within=120)
        if not report.ok:
            print(a.output(80), b.output(80), sep="\n")
        await a.stop_ok()
        await b.stop_ok()
    print(report.text())
    report.assert_ok()
    assert report.duplicate_ids == {}
    await _whole_batches(db_dsn, services.bootstrap, topic, env)


_POINTS = ("eos_after_stamp", "eos_before_commit", "eos_after_commit")


async def test_three_relays_under_a_random_fault_schedule_send_each_event_once(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Three relays share the slots under three writers, through a seeded, shuffled schedule
    of each of these twice: a relay killed (-9) and replaced; a relay joining with the crash
    hook, which kills itself at a random point of its first batch, while another stops
    gracefully and is replaced; a relay frozen past its lease, then resumed. Replay a failure
    with the seed it prints (``NOTIFY_OUTBOX_FAULT_SEED``)."""
    seed = int(os.environ.get("NOTIFY_OUTBOX_FAULT_SEED") or random.SystemRandom().randrange(2**31))
    rng = random.Random(seed)
    print(f"seed {seed}")
    checker = await OutboxChecker(
        db_dsn,
        services.bootstrap,
        [topic],
        f"exactly-once: three relays, random faults (seed {seed})",
        isolation_level="read_committed",
    ).setup()
    async with connect(db_dsn) as conn:
        await conn.execute("UPDATE outbox_config SET delivery = 'exactly-once'")
    # Slots for every worker that may run at once (3 relays of 2, one joining to crash).
    env = _eos_env(NOTIFY_OUTBOX_EOS_SLOTS="16")
    load = checker.writers(writers=3, keys=20, pause=0.01)
    schedule = ["kill", "crash", "freeze"] * 2
    rng.shuffle(schedule)
    started: list[FaultRelay] = []

    def relay(name: str, **extra: str) -> FaultRelay:
        r = FaultRelay(db_dsn, services.bootstrap, env={**env, **extra}, name=name)
        started.append(r)
        return r

    live = [relay(f"relay-{i}") for i in range(3)]
    try:
        async with task_group() as tg:
            for r in live:
                await r.ready()
            tg.start_soon(load.run)
            for n, fault in enumerate(schedule):
                target = load.produced + 150
                await eventually(
                    lambda: _grows(lambda: load.produced, target),  # noqa: B023
                    within=60,
                    what=f"writers produced before fault {n} ({fault})",
                )
                victim = live.pop(rng.randrange(len(live)))
                if fault == "kill":
                    await victim.kill()
                elif fault == "crash":
                    point = rng.choice(_POINTS)
                    crashing = relay(
                        f"crash-{n}", NOTIFY_OUTBOX_TEST_CRASH_AT=point, NOTIFY_OUTBOX_WORKERS="1"
                    )
                    async with relays(crashing):
                        assert await crashing.exited(90) == -signal.SIGKILL, crashing.output()
                    await victim.stop_ok()
                else:
                    victim.signal(signal.SIGSTOP)
                    await anyio.sleep(3.5)  # the fault's length: past the 2 s lease
                    victim.signal(signal.SIGCONT)
                    live.append(victim)
                    continue
                replacement = relay(f"relay-{n + 3}")
                live.append(replacement)
                await replacement.ready()
            await load.halt()
            report = await checker.drain_and_check(within=120)
            for r in live:
                await r.stop_ok()
        # Each crash left a stamped batch that some relay had to settle from the markers.
        recoveries = sum(len(r.matching(r"batch \d+ was in flight")) for r in started)
        assert recoveries >= schedule.count("crash"), recoveries
    except BaseException:
        for r in started:
            print(r.output())
        raise
    finally:
        for r in started:
            r.__exit__(None, None, None)
    print(report.text())
    report.assert_ok()
    assert report.duplicate_ids == {}, f"seed {seed}"
    await _whole_batches(db_dsn, services.bootstrap, topic, env)


async def test_the_batch_check_finds_a_torn_batch_and_an_aborted_read(
    db_dsn: str, services: Services, topic: str
) -> None:
    """The batch check can fail: a marker whose event is not in Kafka (a torn batch), and an
    event no marker lists (what a read of an aborted transaction looks like), each seeded
    with a plain producer, are each found."""
    async with connect(db_dsn) as conn:
        ids = [
            await conn.fetchval(
                "INSERT INTO outbox (topic, key, payload, published_at) "
                "VALUES ($1, 'k', '{}', now()) RETURNING id",
                topic,
            )
            for _ in range(3)
        ]
        events = {
            r["id"]: str(r["event_id"]) for r in await conn.fetch("SELECT id, event_id FROM outbox")
        }
    marker_topic = f"eos-markers-{uuid.uuid4().hex[:8]}"
    await create_topics(services.bootstrap, [marker_topic], partitions=1)
    producer = AIOKafkaProducer(bootstrap_servers=services.bootstrap)
    await producer.start()
    try:
        for row_id in ids[:2]:  # the first two events are in Kafka, the third is not
            header = [("outbox-event-id", events[row_id].encode())]
            await producer.send_and_wait(topic, b"{}", key=b"k", headers=header)
        for seq, listed in ((1, ids[:1]), (2, ids[2:])):  # the second event: no marker
            marker = {"outbox": "public.outbox", "slot": 0, "seq": seq, "ids": listed}
            await producer.send_and_wait(marker_topic, json.dumps(marker).encode(), key=b"s0")
    finally:
        await producer.stop()
    batches = await check_batches(db_dsn, services.bootstrap, topic, marker_topic)
    assert batches.torn == [(0, 2)]
    assert batches.aborted_reads == [events[ids[1]]]
    assert not batches.ok
