"""Exactly-once recovery when another slot's transaction is open (found with the coordinator
kill of ``test_exactly_once_cluster.py``; one broker suffices to show it).

A recovery learns whether a batch committed from the slot's markers, read read_committed.
All slots share the marker partition (one by default), and a read_committed consumer sees
nothing past the partition's last stable offset (LSO): the first offset of the oldest open
transaction. So while another slot's transaction is open, a committed batch's marker written
after it is not visible yet. A recovery that stopped at the LSO judged that batch not
committed and sent it again: a duplicate that read_committed consumers see (50 of them here,
before the fix). The recovery now reads up to the high watermark, waiting for the open
transaction to end.
"""

from __future__ import annotations

import json
import signal
import uuid

import anyio
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from tests.conftest import Services
from tests.faults.checker import OutboxChecker
from tests.faults.eos_batches import check_batches
from tests.faults.harness import FaultRelay, connect, eventually, relays

pytestmark = pytest.mark.anyio


async def _is_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): state T in /proc/<pid>/stat."""
    stat = await anyio.Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


async def _stamped_slots(dsn: str) -> dict[int, int]:
    """Rows in flight per slot."""
    async with connect(dsn) as conn:
        rows = await conn.fetch("SELECT slot, count(*) AS n FROM outbox_eos_stamp GROUP BY slot")
    return {int(r["slot"]): int(r["n"]) for r in rows}


async def _markers(bootstrap: str, topic: str) -> tuple[dict[int, int], int, int]:
    """The offset of each slot's last marker as read_uncommitted sees them (open transactions
    too), and the partition's last stable offset and high watermark."""
    tp = TopicPartition(topic, 0)
    offsets: dict[int, int] = {}
    ends: dict[str, int] = {}
    for isolation in ("read_committed", "read_uncommitted"):
        consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level=isolation
        )
        await consumer.start()
        try:
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            ends[isolation] = (await consumer.end_offsets([tp]))[tp]
            if isolation == "read_uncommitted":
                while await consumer.position(tp) < ends[isolation]:
                    for record in (await consumer.getmany(tp, timeout_ms=500)).get(tp, []):
                        if record.value is not None:
                            offsets[int(json.loads(record.value)["slot"])] = record.offset
        finally:
            await consumer.stop()
    return offsets, ends["read_committed"], ends["read_uncommitted"]


async def test_a_committed_batch_behind_another_slots_open_transaction_is_not_sent_again(
    db_dsn: str, services: Services, topic: str
) -> None:
    checker = await OutboxChecker(
        db_dsn,
        services.bootstrap,
        [topic],
        "exactly-once: a committed batch recovered behind another slot's open transaction",
        isolation_level="read_committed",
    ).setup()
    async with connect(db_dsn) as conn:
        await conn.execute("UPDATE outbox_config SET delivery = 'exactly-once'")
    # 300 keys: the frozen relay's batch (50 rows) holds back 50 of them, the others go.
    async with checker.producer() as p:
        for t in range(3):
            await p.bulk([f"key-{(t * 200 + i) % 300}" for i in range(200)])
    tag = uuid.uuid4().hex[:8]
    marker_topic = f"eos-markers-{tag}"
    env = {
        "NOTIFY_OUTBOX_DELIVERY": "exactly-once",
        "NOTIFY_OUTBOX_EOS_LEASE": "2",
        "NOTIFY_OUTBOX_EOS_SLOTS": "4",
        "NOTIFY_OUTBOX_EOS_TRANSACTION_TIMEOUT": "30",
        "NOTIFY_OUTBOX_EOS_MARKER_TOPIC": marker_topic,
        "NOTIFY_OUTBOX_EOS_TRANSACTIONAL_ID_PREFIX": f"fault-{tag}.",
        "NOTIFY_OUTBOX_KEEP_PUBLISHED": "3600",
        "NOTIFY_OUTBOX_WORKERS": "1",
    }
    # Slot 0: frozen with its transaction open. Its lease outlives the test's recovery, so
    # the recovering relay takes slot 1, not this one; its transaction ends when the broker
    # aborts it at its timeout (10 s, the relay's default; the broker looks every 10 s).
    frozen = FaultRelay(
        db_dsn,
        services.bootstrap,
        env={
            **env,
            "NOTIFY_OUTBOX_EOS_LEASE": "60",
            "NOTIFY_OUTBOX_EOS_TRANSACTION_TIMEOUT": "10",
            "NOTIFY_OUTBOX_TEST_STOP_AT": "eos_before_commit",
        },
        name="frozen",
    )
    async with relays(frozen):
        await eventually(
            lambda: _is_stopped(frozen.proc.pid),
            within=60,
            what="slot 0's relay froze with its transaction open",
        )
        # Slot 1: its batch commits in Kafka, then the relay dies before the database knows.
        crashing = FaultRelay(
            db_dsn,
            services.bootstrap,
            env={**env, "NOTIFY_OUTBOX_TEST_CRASH_AT": "eos_after_commit"},
            name="crashing",
        )
        async with relays(crashing):
            assert await crashing.exited(60) == -signal.SIGKILL, crashing.output()
        assert set(await _stamped_slots(db_dsn)) == {0, 1}
        # The case: slot 1's committed marker lies past the LSO that slot 0's open
        # transaction holds, so read_committed does not show it yet.
        offsets, stable, high = await _markers(services.bootstrap, marker_topic)
        assert stable <= offsets[0] < offsets[1] < high, (offsets, stable, high)
        recovering = FaultRelay(db_dsn, services.bootstrap, env=env, name="recovering")
        async with relays(recovering):
            line = await recovering.line(r"slot 1: batch \d+ was in flight", within=60)
            frozen.signal(signal.SIGCONT)
            report = await checker.drain_and_check(within=90)
            await recovering.stop_ok()
            await frozen.stop_ok()
    print(report.text())
    report.assert_ok()
    assert report.duplicate_ids == {}
    assert "its transaction committed" in line, line
    batches = await check_batches(db_dsn, services.bootstrap, topic, marker_topic)
    assert batches.ok, batches.text()
