"""The publisher's batch path against a stand-in for aiokafka's producer: partitions, waves
(a key's rows for several topics), and the rows a failed batch holds back. Delivery itself
is proven against a real broker in tests/integration (test_relay, test_ack_order)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import uuid
from typing import Any

import anyio
import pytest
from aiokafka import errors as kafka_errors
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.producer.message_accumulator import BatchBuilder

from notify_outbox.core.message import PublishResult
from notify_outbox.core.outbox import OutboxRow
from notify_outbox.kafka.publisher import (
    KafkaPublisher,
    Partitions,
    RowRejected,
    _next_wave,
    to_message,
)
from tests.fakes import fake_settings

pytestmark = pytest.mark.anyio


def row(i: int, key: str | None, topic: str = "a", headers: str | None = None) -> OutboxRow:
    return OutboxRow(i, uuid.uuid4(), topic, key, f'{{"n": {i}}}', None, headers)


class _Cluster:
    def __init__(self, partitions: int) -> None:
        self.partitions = set(range(partitions))
        self.gone: set[str] = set()  # topics deleted: the metadata no longer lists them

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return None if topic in self.gone else self.partitions

    def available_partitions_for_topic(self, topic: str) -> set[int] | None:
        return None if topic in self.gone else self.partitions

    def leader_for_partition(self, _tp: object) -> int:
        return 0


class _Client:
    def __init__(self, partitions: int) -> None:
        self.cluster = _Cluster(partitions)

    async def force_metadata_update(self) -> bool:  # the publisher's probe while acks wait
        return True


class FakeProducer:
    """create_batch/send_batch as aiokafka has them; each batch's ack is a future the test
    resolves. ``sent`` lists (topic, partition, keys) in the order batches were handed over."""

    def __init__(self, partitions: int = 1) -> None:
        self.client = _Client(partitions)
        self.sent: list[tuple[str, int, list[bytes | None]]] = []
        self.acks: list[asyncio.Future[Any]] = []
        self.handed = anyio.Event()

    def create_batch(self) -> BatchBuilder:
        return BatchBuilder(16_384, 0)  # no compression

    async def send_batch(self, batch: BatchBuilder, topic: str, *, partition: int) -> Any:
        keys = [r.key for r in _records(batch)]
        self.sent.append((topic, partition, keys))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.acks.append(fut)
        self.handed.set()
        return fut


def _records(batch: BatchBuilder) -> list[Any]:
    from aiokafka.record.default_records import DefaultRecordBatch

    return list(DefaultRecordBatch(bytearray(batch._build())))


async def _publish_into(
    pub: KafkaPublisher, rows: list[OutboxRow], results: list[PublishResult]
) -> None:
    results.append(await pub.publish(rows))


def publisher(producer: FakeProducer) -> KafkaPublisher:
    pub = KafkaPublisher(fake_settings())
    pub._producer = producer  # type: ignore[assignment]
    return pub


def test_a_wave_holds_one_topic_per_key() -> None:
    rows = [row(1, "k", "a"), row(2, "j", "a"), row(3, "k", "b"), row(4, "k", "a"), row(5, None)]
    wave, later = _next_wave(rows, set())
    assert [r.id for r in wave] == [1, 2, 5]
    assert [r.id for r in later] == [3, 4]  # k's row for b, and everything of k after it
    wave, later = _next_wave(later, set())
    assert [r.id for r in wave] == [3]
    assert [r.id for r in later] == [4]
    # A blocked key's rows are left out: they stay pending.
    assert _next_wave(rows, {"k"}) == ([rows[1], rows[4]], [])


@pytest.mark.parametrize("partitions", [1, 3, 7, 12])
def test_keyed_partitions_are_kafkas_default_ones(partitions: int) -> None:
    # The Java client's and aiokafka's default partitioner: what consumers (and Debezium
    # users) expect for a key.
    chooser, default = Partitions(), DefaultPartitioner()
    producer = FakeProducer(partitions)
    rnd = random.Random(7)
    for _ in range(2000):
        key = rnd.randbytes(rnd.randint(1, 40))
        expected = default(key, list(range(partitions)), list(range(partitions)))
        assert chooser.choose(producer, "t", key) == expected  # type: ignore[arg-type]


async def test_rows_of_a_topic_deleted_after_the_publish_checked_it_fail_as_missing() -> None:
    """The metadata loses a topic between the publish's check and the batching (aiokafka
    refreshes it when another send meets the deleted topic): its rows fail as missing, keyed
    or not, and the other topic's rows are batched (CI once saw a TypeError here)."""
    producer = FakeProducer(3)
    pub = publisher(producer)
    producer.client.cluster.gone.add("gone")
    rows = [row(1, "k", "gone"), row(2, None, "gone"), row(3, "k", "gone"), row(4, "j", "a")]
    result = PublishResult()
    batches = await pub._batch_wave(producer, rows, {}, set(), result)  # type: ignore[arg-type]
    assert result.failed == [
        (1, "topic 'gone' does not exist in Kafka"),
        (2, "topic 'gone' does not exist in Kafka"),
    ]  # row 3 waits behind row 1 (its key)
    expected = ("a", Partitions().choose(producer, "a", b"j"))  # type: ignore[arg-type]
    assert list(batches) == [expected]


def test_malformed_headers_reject_the_row_and_only_it() -> None:
    with pytest.raises(RowRejected, match="not JSON"):
        to_message(row(1, "k", headers="{not json"))
    with pytest.raises(RowRejected, match="JSON object"):
        to_message(row(1, "k", headers="[1]"))
    with pytest.raises(RowRejected):
        to_message(row(1, "k", headers='{"a": 1}'), header_style="debezium")


class _LateCluster:
    """Knows topic "new" only after ``learned`` metadata answers, and never "gone"."""

    def __init__(self) -> None:
        self.partitions = {0}
        self.answers = 0
        self.learned = 2
        #: Topics the principal may not describe (the metadata answer's own error).
        self.unauthorized_topics: set[str] = set()

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        if topic == "new" and self.answers < self.learned:
            return None
        return None if topic == "gone" else self.partitions


class _LateClient:
    """aiokafka's client when a metadata request was already in flight as a topic was added:
    the first answer does not have it yet."""

    def __init__(self) -> None:
        self.cluster = _LateCluster()
        self.added: set[str] = set()

    def add_topic(self, topic: str) -> None:
        self.added.add(topic)

    async def force_metadata_update(self) -> bool:
        self.cluster.answers += 1
        return True


async def test_a_topic_missing_from_a_stale_metadata_answer_is_asked_for_again() -> None:
    producer = FakeProducer()
    client = producer.client = _LateClient()  # type: ignore[assignment]
    pub = publisher(producer)
    assert await pub._missing_topics({"new", "a"}) == {}
    assert client.added == {"new"}
    assert client.cluster.answers == 2
    # A topic that is truly missing: two answers without it, then the row fails.
    assert await pub._missing_topics({"gone"}) == {"gone": "topic 'gone' does not exist in Kafka"}
    # One the principal may not describe is no missing topic: the reason says so.
    client.cluster.unauthorized_topics = {"gone"}
    reason = (await pub._missing_topics({"gone"}))["gone"]
    assert "not authorized" in reason, reason
    assert "TopicAuthorizationFailedError" in reason


async def test_a_malformed_row_is_rejected_at_once_even_for_a_missing_topic() -> None:
    producer = FakeProducer()
    client = producer.client = _LateClient()  # type: ignore[assignment]
    client.cluster.learned = 10**9  # "new" stays missing
    pub = publisher(producer)
    result = await pub.publish([row(1, "k", "new", headers='{"n": 1}'), row(2, "j", "new")])
    assert [i for i, _ in result.rejected] == [1]  # dead-lettered now, not retried
    assert [i for i, _ in result.failed] == [2]
    assert "does not exist" in result.failed[0][1]


async def test_a_keys_row_for_another_topic_waits_for_the_acks_of_the_wave_before() -> None:
    producer = FakeProducer()
    pub = publisher(producer)
    rows = [row(1, "k", "a"), row(2, "j", "a"), row(3, "k", "b"), row(4, "k", "a")]
    results: list[PublishResult] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_publish_into, pub, rows, results)
            await producer.handed.wait()
            await anyio.wait_all_tasks_blocked()  # it must not go on without the ack
            assert producer.sent == [("a", 0, [b"k", b"j"])]
            for n in (1, 2):  # ack each wave; the next one is handed over only then
                producer.handed = anyio.Event()
                producer.acks[-1].set_result(None)
                await producer.handed.wait()
                assert len(producer.sent) == n + 1
            producer.acks[-1].set_result(None)
    assert producer.sent[1:] == [("b", 0, [b"k"]), ("a", 0, [b"k"])]
    assert sorted(results[0].delivered) == [1, 2, 3, 4]


async def test_a_failed_batch_holds_back_its_keys_rows_for_other_topics() -> None:
    producer = FakeProducer()
    pub = publisher(producer)
    rows = [row(1, "k", "a"), row(2, "k", "b"), row(3, "j", "b")]
    results: list[PublishResult] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_publish_into, pub, rows, results)
            await producer.handed.wait()
            while len(producer.sent) < 2:  # wave 1: k's row for a, and j's for b
                producer.handed = anyio.Event()
                await producer.handed.wait()
            producer.acks[0].set_exception(kafka_errors.RecordTooLargeError())
            producer.acks[1].set_result(None)
    result = results[0]
    assert [topic for topic, _, _ in producer.sent] == ["a", "b"]  # k's row for b never went
    assert [i for i, _ in result.failed] == [1]
    assert result.delivered == [3]


async def test_abandoning_a_producer_fails_a_batch_queued_for_retry_without_a_traceback() -> None:
    # A Kafka restart: a batch was sent, the request failed, and aiokafka queued the batch
    # again (reenqueue takes it out of the pending set). Abandoning the producer then fails it;
    # aiokafka's own callback from the first send removes it from the pending set, which
    # raised KeyError in the event loop unless the batch is put back there first.
    from aiokafka.cluster import ClusterMetadata
    from aiokafka.producer.message_accumulator import MessageAccumulator
    from aiokafka.structs import TopicPartition

    from notify_outbox.kafka.publisher import _abandon

    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        accumulator = MessageAccumulator(ClusterMetadata(), 16384, 0, 30)
        tp = TopicPartition("t", 0)
        builder = accumulator.create_builder()
        builder.append(key=None, value=b"v", timestamp=None)
        future = await accumulator.add_batch(builder, tp, timeout=5)
        batch = accumulator._pop_batch(tp)  # sent once
        accumulator.reenqueue(batch)  # the request failed: queued again

        sender_task = asyncio.ensure_future(asyncio.sleep(3600))
        producer = type("P", (), {})()
        producer._sender = type("S", (), {"sender_task": sender_task})()
        producer._message_accumulator = accumulator
        _abandon(producer)  # type: ignore[arg-type]
        with anyio.fail_after(5), contextlib.suppress(Exception):
            await asyncio.shield(future)
        for _ in range(3):
            await asyncio.sleep(0)  # the future's done callbacks run
    finally:
        loop.set_exception_handler(previous)
    assert isinstance(future.exception(), Exception)
    assert "abandoned" in str(future.exception())
    assert errors == []
    assert not accumulator._pending_batches


@pytest.mark.parametrize(
    "big",
    [
        {"payload_bytes": b"x" * 12_000},
        {"key": "k" * 12_000},
        # 5,500 characters, 11,000 bytes in UTF-8
        {"headers": json.dumps({"h": "é" * 5_500}, ensure_ascii=False)},
        {"aggregate_id": "a" * 12_000},
    ],
    ids=["value", "key", "own headers", "relay header"],
)
async def test_a_record_over_the_request_size_fails_alone_whatever_part_is_large(
    big: dict[str, Any],
) -> None:
    """The exact size estimate runs only for records that might be too large; the cheap bound
    that skips it must count every part: key, value, the event's own headers and the relay's."""
    producer = FakeProducer()
    pub = KafkaPublisher(fake_settings(kafka_max_request_size=10_000))
    pub._producer = producer  # type: ignore[assignment]
    fields: dict[str, Any] = {"key": "k", "payload": '{"n": 2}', "payload_bytes": None}
    fields.update(big)
    large = OutboxRow(
        2,
        uuid.uuid4(),
        "a",
        fields["key"],
        fields["payload"],
        fields["payload_bytes"],
        fields.get("headers"),
        aggregate_id=fields.get("aggregate_id"),
    )
    rows = [row(1, "j"), large, row(3, "j")]
    results: list[PublishResult] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_publish_into, pub, rows, results)
            await producer.handed.wait()
            producer.acks[0].set_result(None)
    result = results[0]
    assert [i for i, _ in result.failed] == [2]
    assert "MessageSizeTooLarge" in result.failed[0][1]
    assert sorted(result.delivered) == [1, 3]
