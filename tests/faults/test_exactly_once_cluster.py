"""Exactly-once delivery with the Kafka transaction coordinator killed (issue #35, item 4).

A local three-node KRaft cluster (``devstack.kafka_cluster``: every node broker and
controller, replication factor 3, ``min.insync.replicas`` 2, the transaction state log
likewise), its own JVMs beside the session's single broker. Writers insert keyed events;
two relays in exactly-once mode publish them:

- relay-a (two workers) publishes throughout;
- relay-b (one worker) joins once delivery runs and freezes itself (SIGSTOP,
  ``NOTIFY_OUTBOX_TEST_STOP_AT=eos_before_commit``) with its first batch's records and marker
  acknowledged and its commit not yet sent: a transaction that is certainly open at the
  coordinator when it dies (relay-a's are wherever their batches happen to be).

The node that FindCoordinator names for relay-b's transactional id (``<prefix><slot>``) is
killed with SIGKILL, and relay-b resumed at once: its EndTxn goes to a dead coordinator, and
every transaction after it must find the new one. (devstack's transaction state log has one
partition, so that node coordinates every slot's id, relay-a's too; the test records the
coordinator of each slot held.) Later the node is started again, under the writers. A
read_committed consumer then reads every partition from the beginning: 0 lost, 0
duplicates, 0 order inversions, with no allowance.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from devstack import StackError
from devstack.kafka_cluster import KafkaCluster
from tests.faults.checker import FIGURES, OutboxChecker, WriterLoad
from tests.faults.eos_batches import check_batches
from tests.faults.harness import (
    FaultRelay,
    connect,
    eventually,
    fetchval,
    relays,
    run_blocking,
    task_group,
)

pytestmark = [pytest.mark.anyio, pytest.mark.cluster]

PARTITIONS = 3
REPLICAS = 3
MIN_ISR = "2"

# What a relay logs about Kafka's trouble, for the figures printed with the report.
_RELAY_LINES = {
    "commit outcome unknown, settled from the markers": r"transaction failed \(",
    "recoveries (a batch in flight settled)": r"batch \d+ was in flight",
    "  of which committed": r"was in flight; its transaction committed",
    "batches aborted, Kafka unavailable": r"aborted, Kafka unavailable",
    "producer start retried": r"transactional producer not started",
    "slots lost (fenced or taken over)": r"is no longer this relay's",
}


@pytest.fixture(scope="module")
def cluster(service_dir: Callable[[str], Path]) -> Iterator[KafkaCluster]:
    """Three KRaft nodes of this module's own (outside pytest's temporary directories, as
    the session's services: another pytest session may prune those)."""
    nodes = KafkaCluster(service_dir("kafka-cluster"))
    try:
        nodes.start_all()
    except StackError as e:
        pytest.fail(
            f"no three-node Kafka cluster for this test: {e}\n"
            "It needs Java 17 and Maven (for the Kafka jars, cached after the first run) and "
            "about 1.5 GB of memory (three 512 MB heaps).",
            pytrace=False,
        )
    try:
        yield nodes
    finally:
        nodes.stop_all()


async def _create_replicated_topic(bootstrap: str, name: str) -> None:
    """A topic as a production cluster that survives one node has it: RF 3, min ISR 2;
    returns once every partition has a leader."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        response = await admin.create_topics(
            [
                NewTopic(
                    name,
                    PARTITIONS,
                    replication_factor=REPLICAS,
                    topic_configs={"min.insync.replicas": MIN_ISR},
                )
            ]
        )
        assert response.topic_errors[0][1] == 0, response

        async def led() -> bool:
            described: Any = (await admin.describe_topics([name]))[0]
            parts = described["partitions"]
            return len(parts) == PARTITIONS and all(p["leader"] >= 0 for p in parts)

        await eventually(led, within=60, what=f"topic {name} has a leader per partition")
    finally:
        await admin.close()


async def _replication(bootstrap: str, topic: str) -> tuple[list[int], str, list[int]]:
    """Each partition's replica count, the topic's ``min.insync.replicas`` and each
    partition's leader (node id), as the cluster describes them. A node may not know a topic
    created a moment ago (the relay's marker topic): ask until one answers in full."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    found: tuple[list[int], str, list[int]] | None = None

    async def described() -> bool:
        nonlocal found
        topics: Any = await admin.describe_topics([topic])
        parts = sorted(topics[0]["partitions"], key=lambda p: p["partition"])
        if topics[0]["error_code"] or not parts or any(p["leader"] < 0 for p in parts):
            return False
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, configs={"min.insync.replicas": ""})]
        )
        for response in responses:
            for resource in response.resources:  # (error, message, type, name, entries)
                for entry in resource[4]:  # (name, value, read_only, ...)
                    if not resource[0] and entry[0] == "min.insync.replicas":
                        found = (
                            [len(p["replicas"]) for p in parts],
                            str(entry[1]),
                            [p["leader"] for p in parts],
                        )
        return found is not None

    try:
        await eventually(described, within=30, what=f"the cluster describes topic {topic}")
    finally:
        await admin.close()
    assert found is not None
    return found


async def _count(dsn: str, sql: str, *args: object) -> int:
    return int(await fetchval(dsn, sql, *args))


async def _at_least(count: Awaitable[int], target: int) -> bool:
    return await count >= target


async def _produced(load: WriterLoad, target: int) -> bool:
    return load.produced >= target


async def _is_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): state T in /proc/<pid>/stat."""
    stat = await anyio.Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


async def _slot_of(dsn: str, pid: int) -> int:
    """The slot a relay process holds: its owner is ``host:pid:token/worker``."""
    async with connect(dsn) as conn:
        slots = await conn.fetch(
            "SELECT slot FROM outbox_eos_slot WHERE owner LIKE $1", f"%:{pid}:%"
        )
    assert len(slots) == 1, f"relay {pid} holds slots {slots}"
    return int(slots[0]["slot"])


async def _held_slots(dsn: str) -> list[int]:
    async with connect(dsn) as conn:
        rows = await conn.fetch(
            "SELECT slot FROM outbox_eos_slot WHERE owner IS NOT NULL AND expires_at > now() "
            "ORDER BY slot"
        )
    return [int(r["slot"]) for r in rows]


def _relay_figures(procs: list[FaultRelay]) -> dict[str, int]:
    return {
        what: sum(len(p.matching(pattern)) for p in procs) for what, pattern in _RELAY_LINES.items()
    }


async def test_the_transaction_coordinator_killed_under_writers_sends_each_event_once(
    db_dsn: str, cluster: KafkaCluster
) -> None:
    bootstrap = cluster.bootstrap
    assert cluster.running() == [0, 1, 2], "the cluster must start with its three nodes"
    topic = f"t-{uuid.uuid4().hex[:12]}"
    await _create_replicated_topic(bootstrap, topic)
    checker = await OutboxChecker(
        db_dsn,
        bootstrap,
        [topic],
        "exactly-once: the transaction coordinator killed (3-node cluster)",
        isolation_level="read_committed",
    ).setup()
    async with connect(db_dsn) as conn:
        await conn.execute("UPDATE outbox_config SET delivery = 'exactly-once'")
    tag = uuid.uuid4().hex[:8]
    prefix = f"fault-{tag}."
    marker_topic = f"eos-markers-{tag}"
    env = {
        "NOTIFY_OUTBOX_DELIVERY": "exactly-once",
        # Far above relay-b's freeze (the kill takes well under a second), so its slot is
        # not taken over meanwhile: this test is about the coordinator, not a zombie.
        "NOTIFY_OUTBOX_EOS_LEASE": "6",
        "NOTIFY_OUTBOX_EOS_SLOTS": "4",
        "NOTIFY_OUTBOX_EOS_TRANSACTION_TIMEOUT": "30",
        "NOTIFY_OUTBOX_EOS_MARKER_TOPIC": marker_topic,
        "NOTIFY_OUTBOX_EOS_TRANSACTIONAL_ID_PREFIX": prefix,
        "NOTIFY_OUTBOX_KEEP_PUBLISHED": "3600",
    }
    load = checker.writers(writers=3, keys=20, pause=0.01)
    a = FaultRelay(db_dsn, bootstrap, env=env, name="relay-a")
    started = [a]
    async with relays(a), task_group() as tg:
        await a.ready()
        # The event topic, and the marker topic the relay created (min(3, nodes) replicas):
        # replicated on every node, refusing a write that fewer than two replicas hold.
        # Their leaders (for the report) do not move until the kill.
        leaders: dict[str, list[int]] = {}
        for name in (topic, marker_topic):
            replicas, min_isr, leaders[name] = await _replication(bootstrap, name)
            assert set(replicas) == {REPLICAS}, (name, replicas)
            assert min_isr == MIN_ISR, (name, min_isr)
        tg.start_soon(load.run)
        # Transactions commit through the first coordinator before the fault.
        await eventually(
            lambda: _at_least(
                _count(db_dsn, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL"), 200
            ),
            within=60,
            what="relay-a published 200 events before the fault",
        )
        b = FaultRelay(
            db_dsn,
            bootstrap,
            env={
                **env,
                "NOTIFY_OUTBOX_WORKERS": "1",
                "NOTIFY_OUTBOX_TEST_STOP_AT": "eos_before_commit",
            },
            name="relay-b",
        )
        started.append(b)
        async with relays(b):
            await eventually(
                lambda: _is_stopped(b.proc.pid),
                within=60,
                what="relay-b froze with its first transaction open",
            )
            b_slot = await _slot_of(db_dsn, b.proc.pid)
            frozen = await _stamped(db_dsn, b_slot)
            assert frozen, "relay-b froze without a stamped batch"
            held = await _held_slots(db_dsn)
            coordinators = {
                slot: await run_blocking(
                    lambda slot=slot: cluster.find_coordinator(f"{prefix}{slot}")
                )
                for slot in held
            }
            victim = coordinators[b_slot]
            # Kill the coordinator, then resume relay-b at once: its commit meets the dead
            # node (or the survivors that still name it, until the controller fences it).
            await run_blocking(lambda: cluster.kill(victim))
            killed_at = time.monotonic()
            killed_ts: datetime = await fetchval(db_dsn, "SELECT clock_timestamp()")
            b.signal(signal.SIGCONT)
            assert cluster.running() == [i for i in range(3) if i != victim]
            # Delivery goes on through a new coordinator: an event written after the kill is
            # published (the relay marks a row only once its Kafka transaction committed).
            await eventually(
                lambda: _at_least(
                    _count(
                        db_dsn,
                        "SELECT count(*) FROM fault_commits AS f JOIN outbox AS o USING (event_id) "
                        "WHERE f.committed_at > $1 AND o.published_at IS NOT NULL",
                        killed_ts,
                    ),
                    1,
                ),
                within=60,
                what="an event written after the coordinator's kill was published",
                interval=0.1,
            )
            outage = time.monotonic() - killed_at
            # relay-b's open transaction was settled: committed through the new coordinator,
            # or (its outcome unknown) settled from the markers and its rows sent again.
            await eventually(
                lambda: _at_least(
                    _count(
                        db_dsn,
                        "SELECT count(*) FROM outbox WHERE id = ANY($1::bigint[]) "
                        "AND published_at IS NOT NULL",
                        sorted(frozen),
                    ),
                    len(frozen),
                ),
                within=60,
                what="relay-b's frozen batch was published",
                interval=0.1,
            )
            frozen_settled = time.monotonic() - killed_at
            moved_to = await run_blocking(lambda: cluster.find_coordinator(f"{prefix}{b_slot}"))
            # The node again, under the writers: it recovers its logs and catches up.
            await run_blocking(lambda: cluster.start(victim))
            restarted_after = time.monotonic() - killed_at
            target = load.produced + 200
            await eventually(
                lambda: _produced(load, target),
                within=60,
                what="writers produced after the node's restart",
            )
            await load.halt()
            report = await checker.drain_and_check(within=90)
            await b.stop_ok()
        await a.stop_ok()
    figures = _relay_figures(started)
    after_kill = await _count(
        db_dsn, "SELECT count(*) FROM fault_commits WHERE committed_at > $1", killed_ts
    )
    print(report.text())
    print(
        f"coordinators of the held slots {coordinators} (node index); killed node "
        f"{victim} (id {victim + 1}), which led marker partitions {leaders[marker_topic]} / event "
        f"partitions {leaders[topic]} (leader ids); the coordinator moved to {moved_to}\n"
        f"relay-b's open batch: {len(frozen)} rows, published {frozen_settled:.1f}s after the "
        f"kill; the first event written after the kill published {outage:.1f}s after it; "
        f"the node served again {restarted_after:.1f}s after it; {after_kill} events "
        f"committed after the kill\n" + "\n".join(f"{what}: {n}" for what, n in figures.items())
    )
    print("relay logs:", ", ".join(str(p.dump()) for p in started))
    FIGURES.recovery("exactly-once coordinator kill: first event after", outage)
    FIGURES.notes["exactly-once coordinator kill: relay log lines"] = figures
    report.assert_ok()
    assert report.duplicate_ids == {}
    batches = await check_batches(db_dsn, bootstrap, topic, marker_topic)
    assert batches.ok, batches.text()
    assert after_kill > 0
    # The fault was the one meant: the killed node coordinated relay-b's open transaction
    # (and every transaction of relay-a after it went through another one).
    assert coordinators[b_slot] == victim
    assert moved_to != victim


async def _stamped(dsn: str, slot: int) -> set[int]:
    """The row ids of the batch ``slot`` has in flight."""
    async with connect(dsn) as conn:
        rows = await conn.fetch("SELECT id FROM outbox_eos_stamp WHERE slot = $1", slot)
    return {int(r["id"]) for r in rows}
