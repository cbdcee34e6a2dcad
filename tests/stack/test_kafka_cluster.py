"""The local three-node KRaft cluster (devstack.kafka_cluster) replicates and survives a node.

Its own JVMs, not the session's single broker: it starts three nodes, creates a topic with
replication factor 3, kills one node with SIGKILL and still writes with ``acks=all``
(``min.insync.replicas=2``), then reads everything back.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from devstack.kafka_cluster import KafkaCluster

pytestmark = pytest.mark.cluster  # `make test` runs it on its own, after the rest

# Generous: three JVMs share two cores with whatever else runs.
WAIT_S = 60.0
PARTITIONS = 3


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[KafkaCluster]:
    nodes = KafkaCluster(tmp_path / "cluster")
    nodes.start_all()
    try:
        yield nodes
    finally:
        nodes.stop_all()


async def _create_topic(bootstrap: str, name: str) -> list[list[int]]:
    """Create an RF-3 topic; return each partition's replica node ids."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, PARTITIONS, replication_factor=3)])
        # The node that answers may not have the new topic's metadata yet.
        deadline = time.monotonic() + WAIT_S
        while True:
            described: Any = await admin.describe_topics([name])
            partitions = described[0]["partitions"]
            if len(partitions) == PARTITIONS or time.monotonic() > deadline:
                return [sorted(p["replicas"]) for p in partitions]
            await asyncio.sleep(0.2)
    finally:
        await admin.close()


async def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, enable_idempotence=True, acks="all", request_timeout_ms=10000
    )
    await producer.start()
    try:
        for i, value in enumerate(values):
            await asyncio.wait_for(
                producer.send_and_wait(topic, value, partition=i % PARTITIONS), WAIT_S
            )
    finally:
        await producer.stop()


async def _consume(bootstrap: str, topic: str, count: int) -> list[bytes]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    try:
        values: list[bytes] = []
        while len(values) < count:
            record: Any = await asyncio.wait_for(consumer.getone(), WAIT_S)
            values.append(record.value)
        return values
    finally:
        await consumer.stop()


def test_cluster_writes_acks_all_with_a_node_killed(cluster: KafkaCluster) -> None:
    assert cluster.running() == [0, 1, 2]
    topic = f"cluster-{uuid.uuid4().hex[:12]}"
    replicas = asyncio.run(_create_topic(cluster.bootstrap, topic))
    assert replicas == [[1, 2, 3]] * PARTITIONS

    before = [f"before-{i}".encode() for i in range(PARTITIONS)]
    asyncio.run(_produce(cluster.bootstrap, topic, before))

    victim = cluster.find_coordinator(f"txn-{uuid.uuid4().hex}")
    cluster.kill(victim)
    assert cluster.running() == [i for i in range(3) if i != victim]
    # Every partition had a replica on the victim; two of three are still in sync.
    after = [f"after-{i}".encode() for i in range(PARTITIONS)]
    asyncio.run(_produce(cluster.bootstrap, topic, after))
    # The transaction coordinator moved to a live node.
    assert cluster.find_coordinator(f"txn-{uuid.uuid4().hex}") != victim

    assert sorted(asyncio.run(_consume(cluster.bootstrap, topic, 2 * PARTITIONS))) == sorted(
        before + after
    )

    started = time.monotonic()
    cluster.start(victim)
    assert cluster.running() == [0, 1, 2]
    assert time.monotonic() - started < WAIT_S
