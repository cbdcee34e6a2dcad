"""The inbox end to end: exactly-once application downstream of an at-least-once relay.

A producer writes business rows (``orders``) and their events with ``enqueue`` in one
transaction each; the relay (a subprocess) publishes them; two consumer processes of one
group apply them to their own database through the inbox. Meanwhile a seeded schedule kills
the relay and the consumers with SIGKILL and restarts them. The first consumer also kills
itself once right after a database commit, before its Kafka offsets are committed, so at
least one redelivery is certain. One consumer is made a zombie deterministically: armed by
SIGUSR1, it stops itself (SIGSTOP) holding a batch it fetched and has not applied; it stays
frozen until the group has given all its partitions to the other (past ``session.timeout.ms``)
and the other has applied that batch; then it is resumed (SIGCONT) and applies the batch it
holds, unaware. Its log says what it did: the test checks that its transaction found every held
id recorded and applied none, that each held message was applied once (by the survivor), and
that Kafka refused its offset commit. The test
runs once per consumer path: ``consume`` (a handler per message) and ``consume_batches`` (one
INSERT per batch of fresh messages). At the end, every committed order was applied exactly once
(counted in the consumer's table, which has no unique constraint that could hide a double
apply), none is missing, and none appeared that was not committed.

Replay a run with ``NOTIFY_OUTBOX_FAULT_SEED=<seed>`` (the seed is printed).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
import uuid
from typing import Any

import anyio
import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer

import notify_outbox
from devstack.relayproc import LoggedProcess, child_env
from notify_outbox.inbox import migrate_inbox
from tests.conftest import Services
from tests.faults.checker import FIGURES
from tests.faults.harness import FaultRelay, connect, eventually, partitions, relays, task_group
from tests.faults.inbox_consumer import SETUP_SQL as CONSUMER_SQL
from tests.support import create_topics

pytestmark = pytest.mark.anyio

EVENTS = 1200
PARTITIONS = 4
PRODUCE_SECONDS = 12.0
CHAOS_SECONDS = 16.0
PRODUCER_SQL = """
CREATE TABLE orders (
    id       bigint  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    total    integer NOT NULL,
    event_id uuid    NOT NULL UNIQUE
)
"""


class ConsumerProcess(LoggedProcess):
    """``python -m tests.faults.inbox_consumer`` as a subprocess, its log read by a thread."""

    def __init__(self, env: dict[str, str], name: str, *, crash_after: int = 0) -> None:
        super().__init__(
            [sys.executable, "-m", "tests.faults.inbox_consumer"],
            child_env(**env, INBOX_TEST_NAME=name, INBOX_TEST_CRASH_AFTER=str(crash_after)),
            name=name,
        )

    async def ready(self, within: float = 60.0) -> None:
        await anyio.to_thread.run_sync(lambda: self.wait_for_line("consumer running", within))

    async def kill(self) -> None:
        self.proc.kill()
        await anyio.to_thread.run_sync(lambda: self.proc.wait(30))

    def assignments(self, partitions: int) -> int:
        """How many times the group gave this consumer all ``partitions``."""
        return len(self.matching(rf"partitions assigned: {partitions}$"))

    async def assigned_all(self, partitions: int, count: int, within: float = 60.0) -> None:
        """Until the group gave this consumer all ``partitions`` for the ``count``-th time."""
        pattern = rf"partitions assigned: {partitions}$"
        await anyio.to_thread.run_sync(lambda: self.wait_for_line(pattern, within, count=count))


async def produce(dsn: str, topic: str, rng: random.Random) -> int:
    """Orders and their events, one to five per transaction, spread over PRODUCE_SECONDS."""
    written = 0
    started = time.monotonic()
    async with connect(dsn) as conn:
        while written < EVENTS:
            n = min(rng.randint(1, 5), EVENTS - written)
            async with conn.transaction():
                for _ in range(n):
                    total = rng.randint(1, 500)
                    order_id = await conn.fetchval(
                        "INSERT INTO orders (total, event_id) VALUES ($1, gen_random_uuid()) "
                        "RETURNING id",
                        total,
                    )
                    event_id = await notify_outbox.enqueue(
                        conn,
                        topic=topic,
                        key=f"customer-{order_id % 40}",
                        payload={"order_id": order_id, "total": total},
                    )
                    await conn.execute(
                        "UPDATE orders SET event_id = $1 WHERE id = $2", event_id, order_id
                    )
            written += n
            due = started + PRODUCE_SECONDS * written / EVENTS
            await anyio.sleep(max(0.0, due - time.monotonic()))  # a rate, not a synchronisation
    return written


@pytest.mark.parametrize("path", ["each", "batch"])
async def test_every_order_is_applied_exactly_once_through_kills(
    services: Services, db_dsn: str, empty_db_dsn: str, path: str
) -> None:
    seed = int(os.environ.get("NOTIFY_OUTBOX_FAULT_SEED", "0")) or random.randrange(1, 10**9)
    rng = random.Random(seed)
    print(f"inbox e2e ({path} path): seed {seed}")
    started = time.monotonic()
    topic = f"orders-{uuid.uuid4().hex[:8]}"
    await create_topics(services.bootstrap, [topic], partitions=PARTITIONS)
    async with connect(db_dsn) as conn:
        await conn.execute(PRODUCER_SQL)
    async with connect(empty_db_dsn) as conn:
        await migrate_inbox(conn)
        await conn.execute(CONSUMER_SQL)
    consumer_env = {
        "INBOX_TEST_DSN": empty_db_dsn,
        "INBOX_TEST_BOOTSTRAP": services.bootstrap,
        "INBOX_TEST_TOPIC": topic,
        "INBOX_TEST_GROUP": f"orders-projection-{uuid.uuid4().hex[:6]}",
        "INBOX_TEST_PATH": path,
    }
    kills = {"relay": 0, "consumer": 0, "self": 0, "zombie": 0}
    generation = {"relay": 0, "c0": 0, "c1": 0}
    procs: dict[str, FaultRelay | ConsumerProcess] = {}
    # What the zombie held when it froze and did after it resumed (read from its log).
    zombie_seen: dict[str, Any] = {}

    def start(which: str) -> FaultRelay | ConsumerProcess:
        generation[which] += 1
        name = f"{which}#{generation[which]}"
        if which == "relay":
            # The first relay crashes itself after Kafka acknowledged its first batch, before
            # marking it: that batch is certainly published twice.
            env = {"NOTIFY_OUTBOX_TEST_CRASH_AT": "after_ack"} if name == "relay#1" else {}
            proc: FaultRelay | ConsumerProcess = FaultRelay(
                db_dsn, services.bootstrap, env=env, name=name
            )
        else:
            # The first consumer crashes itself once, in the commit-to-offset window (after
            # its 10th commit: a message's or a partition batch's, by the path).
            crash = 10 if name == "c0#1" else 0
            proc = ConsumerProcess(consumer_env, name, crash_after=crash)
        procs[which] = proc
        return proc

    async def ready(proc: FaultRelay | ConsumerProcess) -> None:
        await proc.ready()

    all_started: list[FaultRelay | ConsumerProcess] = []
    try:
        for which in ("relay", "c0", "c1"):
            all_started.append(start(which))
        for proc in all_started:
            await ready(proc)

        def all_alive(which: list[str]) -> None:
            dead = [procs[w] for w in which if procs[w].proc.poll() is not None]
            assert not dead, "a process died by itself:\n" + "\n".join(p.output() for p in dead)

        async def chaos(candidates: list[str], rng: random.Random) -> None:
            until = time.monotonic() + CHAOS_SECONDS
            while time.monotonic() < until:
                await anyio.sleep(rng.uniform(0.3, 1.5))  # the fault schedule
                all_alive(candidates)  # only the kills of this schedule end a process
                victim = rng.choice(candidates)
                await procs[victim].kill()
                kills["relay" if victim == "relay" else "consumer"] += 1
                await anyio.sleep(rng.uniform(0.0, 0.5))
                all_started.append(start(victim))
                await ready(procs[victim])

        async def faults() -> None:
            # First the scripted crashes (relay#1 after an ack, c0#1 after a commit): they
            # come within the first second or two of production. Then the random ones, on two
            # schedules side by side (relay; consumers), each with its own seeded RNG.
            for which in ("relay", "c0"):
                proc = procs[which]
                await anyio.to_thread.run_sync(lambda p=proc: p.proc.wait(30))  # type: ignore[misc]
                kills["self"] += 1
                all_started.append(start(which))
                await ready(procs[which])
            async with task_group() as tg:
                tg.start_soon(chaos, ["relay"], random.Random(rng.random()))
                tg.start_soon(consumer_faults, random.Random(rng.random()))

        async def consumer_faults(rng: random.Random) -> None:
            await zombie("c1", "c0")
            await chaos(["c0", "c1"], rng)

        async def zombie(frozen: str, other: str) -> None:
            """Freeze ``frozen`` while it holds a fetched, unapplied batch, until the group gave
            all partitions to ``other`` (its session timed out) and ``other`` applied that
            batch; then let it run on, unaware, as a zombie, and read what it did."""
            victim, survivor = procs[frozen], procs[other]
            assert isinstance(victim, ConsumerProcess)
            assert isinstance(survivor, ConsumerProcess)
            # A member of the group (else freezing it would not make the group move on).
            await anyio.to_thread.run_sync(
                lambda: victim.wait_for_line(r"partitions assigned: [1-9]", 60)
            )
            before = survivor.assignments(PARTITIONS)
            # Armed, it stops itself (SIGSTOP) before applying the next batch it fetched.
            victim.signal(signal.SIGUSR1)
            line = await anyio.to_thread.run_sync(
                lambda: victim.wait_for_line(r"zombie: holding \d+ messages", 60)
            )
            held = line.rsplit("ids: ", 1)[1].split(",")
            zombie_seen.update(name=victim.name, survivor=survivor.name, held=held)
            await eventually(
                lambda: _stopped(victim.proc.pid),
                within=30,
                what=f"{victim.name} stopped itself",
            )
            try:
                await survivor.assigned_all(PARTITIONS, before + 1)

                async def survivor_applied_held() -> bool:
                    async with connect(empty_db_dsn) as conn:
                        n = await conn.fetchval(
                            "SELECT count(*) FROM inbox WHERE consumer = 'orders' "
                            "AND event_id = ANY($1::text[])",
                            held,
                        )
                    return int(n) == len(held)

                # The interesting case: the batch the zombie holds is already applied by the
                # partitions' new owner when the zombie resumes.
                await eventually(
                    survivor_applied_held,
                    within=60,
                    what=f"{survivor.name} applied the {len(held)} messages the zombie holds",
                    interval=0.1,
                )
            finally:
                victim.signal(signal.SIGCONT)
            kills["zombie"] += 1
            applied_line = await anyio.to_thread.run_sync(
                lambda: victim.wait_for_line(r"zombie: resumed, applied \d+ of", 60)
            )
            words = applied_line.split("zombie: resumed, applied ", 1)[1].split()
            zombie_seen["applied_after_resume"] = int(words[0])
            commit_line = await anyio.to_thread.run_sync(
                lambda: victim.wait_for_line(r"zombie: offset commit of the held batch", 60)
            )
            zombie_seen["offset_commit"] = commit_line.rsplit(": ", 1)[1]

        async with task_group() as tg:
            tg.start_soon(faults)
            written = await produce(db_dsn, topic, random.Random(rng.random()))
        all_alive(list(procs))

        async with connect(db_dsn) as conn:
            expected = {str(r["event_id"]) for r in await conn.fetch("SELECT event_id FROM orders")}
        assert len(expected) == written == EVENTS

        async def all_applied() -> bool:
            async with connect(empty_db_dsn) as conn:
                n = await conn.fetchval("SELECT count(DISTINCT event_id) FROM consumer_orders")
            return int(n) >= len(expected)

        await eventually(
            all_applied,
            within=60,
            what="the consumers applied every order",
            interval=0.2,
            details=lambda: "\n".join(p.output() for p in procs.values()),
        )
        async with connect(empty_db_dsn) as conn:
            counts = {
                r["event_id"]: r["n"]
                for r in await conn.fetch(
                    "SELECT event_id, count(*) AS n FROM consumer_orders GROUP BY event_id"
                )
            }
            repeats = int(await conn.fetchval("SELECT count(*) FROM consumer_repeats"))
            held_by = {
                r["event_id"]: r["applied_by"]
                for r in await conn.fetch(
                    "SELECT event_id, applied_by FROM consumer_orders "
                    "WHERE event_id = ANY($1::text[])",
                    zombie_seen.get("held", []),
                )
            }
            zombie_repeats = int(
                await conn.fetchval(
                    "SELECT count(DISTINCT event_id) FROM consumer_repeats "
                    "WHERE seen_by = $1 AND event_id = ANY($2::text[])",
                    zombie_seen.get("name", ""),
                    zombie_seen.get("held", []),
                )
            )
            mismatched = await conn.fetchval(
                "SELECT count(*) FROM consumer_orders c WHERE NOT EXISTS (SELECT 1 FROM inbox i "
                "WHERE i.consumer = 'orders' AND i.event_id = c.event_id)"
            )
        async with connect(db_dsn) as conn:
            wrong_totals = await _wrong_totals(conn, empty_db_dsn)
        published = await _messages_in(services.bootstrap, topic)
    finally:
        for proc in all_started:
            if isinstance(proc, ConsumerProcess):
                proc.close()
        async with relays(*[p for p in all_started if isinstance(p, FaultRelay)]):
            pass

    doubles = {e: n for e, n in counts.items() if n > 1}
    held = zombie_seen.get("held", [])
    missing = expected - counts.keys()
    phantom = counts.keys() - expected
    figures = {
        "events": len(expected),
        "applied_once": sum(1 for n in counts.values() if n == 1),
        "applied_twice_or_more": len(doubles),
        "missing": len(missing),
        "phantom": len(phantom),
        "relay_kills": kills["relay"],
        "consumer_kills": kills["consumer"],
        "self_crashes": kills["self"],
        "zombies": kills["zombie"],
        "zombie_held": len(zombie_seen.get("held", [])),
        "zombie_applied_after_resume": zombie_seen.get("applied_after_resume"),
        "zombie_repeats_of_held": zombie_repeats,
        "zombie_offset_commit": zombie_seen.get("offset_commit"),
        # Offset commits refused because the group had moved on (a zombie's, or a killed
        # member's partitions reassigned meanwhile): a count for the record, not a check.
        "stale_offset_commits": sum(
            len(p.matching("offset commit after a rebalance failed"))
            for p in all_started
            if isinstance(p, ConsumerProcess)
        ),
        "path": path,
        "kafka_messages": published,
        "kafka_duplicates_from_relay": published - len(expected),
        "repeats_absorbed_by_inbox": repeats,
        "seconds": round(time.monotonic() - started, 1),
        "seed": seed,
    }
    FIGURES.notes[f"inbox end to end ({path})"] = figures
    print(f"inbox e2e figures: {figures}")
    # The zombie: it resumed holding a batch the survivor had applied; its transaction found
    # every id recorded and applied none of them; each held message was applied once, by the
    # survivor; and Kafka refused the zombie's offset commit (its generation was over).
    assert kills["zombie"] == 1, f"no consumer was frozen past its session ({figures})"
    assert held, f"the zombie held no batch ({figures})"
    assert zombie_seen.get("applied_after_resume") == 0, (
        f"the zombie applied {zombie_seen.get('applied_after_resume')} of the {len(held)} "
        f"messages it held after resuming: the survivor had applied them ({figures})"
    )
    assert zombie_repeats == len(set(held)), (
        f"the zombie's transaction found {zombie_repeats} of its {len(set(held))} held ids "
        f"recorded ({figures})"
    )
    assert {e: counts.get(e, 0) for e in held} == dict.fromkeys(held, 1), (
        f"a held message was not applied exactly once ({figures})"
    )
    assert set(held_by.values()) == {zombie_seen["survivor"]}, (
        f"held messages applied by {set(held_by.values())}, not by the survivor only ({figures})"
    )
    assert zombie_seen.get("offset_commit", "").startswith("refused"), (
        f"the zombie's offset commit after resuming: {zombie_seen.get('offset_commit')} ({figures})"
    )
    assert not doubles, f"applied more than once: {list(doubles.items())[:5]} ({figures})"
    assert not missing, f"{len(missing)} orders never applied ({figures})"
    assert not phantom, f"{len(phantom)} applied orders were never committed ({figures})"
    assert mismatched == 0, "business rows without their inbox id: not one transaction"
    assert wrong_totals == 0, "an applied order differs from what the producer wrote"
    # The scripted crashes (relay after an ack, consumer after a commit) make repeats certain.
    assert published > len(expected), f"the relay published no duplicate ({figures})"
    assert repeats >= 1, f"the inbox absorbed no repeat: the test exercised nothing ({figures})"


async def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc/<pid>/stat)."""
    stat = await anyio.Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


async def _wrong_totals(producer: asyncpg.Connection, consumer_dsn: str) -> int:
    written = {
        str(r["event_id"]): (r["id"], r["total"])
        for r in await producer.fetch("SELECT id, total, event_id FROM orders")
    }
    async with connect(consumer_dsn) as conn:
        rows = await conn.fetch("SELECT event_id, order_id, total FROM consumer_orders")
    return sum(1 for r in rows if written.get(r["event_id"]) != (r["order_id"], r["total"]))


async def _messages_in(bootstrap: str, topic: str) -> int:
    """How many messages the topic holds (end offsets): the relay's duplicates included."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = await partitions(consumer, [topic])
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()
