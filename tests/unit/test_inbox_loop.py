"""The inbox's Kafka loop (``consume`` / ``consume_batches``) with a fake consumer and a fake
apply step: which offsets it commits, and when. The database and Kafka parts are proven in
tests/integration/test_inbox_batch.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from aiokafka import TopicPartition

from notify_outbox.inbox import BatchResult, HandlerFailed
from notify_outbox.inbox.loop import _consume

pytestmark = pytest.mark.anyio


class _Stop(Exception):
    """Ends the loop once the scripted fetches are used up."""


@dataclass
class Rec:
    offset: int


class FakeConsumer:
    _enable_auto_commit = False

    def __init__(self, fetches: list[dict[TopicPartition, list[Rec]]]) -> None:
        self.fetches = fetches
        self.commits: list[dict[TopicPartition, int]] = []
        self.listener: Any = None

    def subscribe(self, topics: list[str], listener: Any = None) -> None:
        self.listener = listener

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition("t", p) for p in range(3)}

    async def getmany(self, timeout_ms: int, max_records: int) -> dict[TopicPartition, list[Rec]]:
        if not self.fetches:
            raise _Stop
        return self.fetches.pop(0)

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(dict(offsets))


def tp(p: int) -> TopicPartition:
    return TopicPartition("t", p)


def recs(first: int, n: int) -> list[Rec]:
    return [Rec(o) for o in range(first, first + n)]


async def run(consumer: FakeConsumer, apply: Any) -> None:
    await _consume(
        consumer,
        None,  # type: ignore[arg-type]  # the fake apply needs no database
        apply,
        max_records=500,
        poll_timeout=0.1,
        topics=["t"],
        listener=None,
        concurrency=1,
    )


async def test_one_offset_commit_per_fetch_after_every_partition_is_applied() -> None:
    applied: list[tuple[int, int]] = []
    commits_when_applied: list[int] = []
    consumer = FakeConsumer(
        [
            {tp(0): recs(0, 5), tp(1): recs(10, 3), tp(2): recs(7, 2)},
            {tp(1): recs(13, 4)},
        ]
    )

    async def apply(records: list[Rec]) -> BatchResult:
        commits_when_applied.append(len(consumer.commits))
        applied.append((records[0].offset, len(records)))
        return BatchResult(done=len(records), applied=len(records))

    with pytest.raises(_Stop):
        await run(consumer, apply)
    assert applied == [(0, 5), (10, 3), (7, 2), (13, 4)]
    # No offset moves before its database work: the first fetch's three batches all ran
    # before its (single) commit.
    assert commits_when_applied == [0, 0, 0, 1]
    assert consumer.commits == [{tp(0): 5, tp(1): 13, tp(2): 9}, {tp(1): 17}]
    assert consumer.listener._pending == {}


async def test_a_failing_partition_commits_what_was_done_and_starts_no_later_one() -> None:
    consumer = FakeConsumer([{tp(0): recs(0, 5), tp(1): recs(0, 6), tp(2): recs(0, 4)}])
    started: list[int] = []

    async def apply(records: list[Rec]) -> BatchResult:
        started.append(len(records))
        if len(records) == 6:
            failed = HandlerFailed("the handler failed on message (offset 4)", records[4])
            failed.result = BatchResult(done=4, applied=4)
            raise failed
        return BatchResult(done=len(records), applied=len(records))

    with pytest.raises(HandlerFailed, match="offset 4"):
        await run(consumer, apply)
    assert started == [5, 6]  # partition 2 never started
    assert consumer.commits == [{tp(0): 5, tp(1): 4}]


async def test_an_error_outside_the_handler_commits_the_partitions_before_it_only() -> None:
    consumer = FakeConsumer([{tp(0): recs(0, 2), tp(1): recs(0, 7)}])

    async def apply(records: list[Rec]) -> BatchResult:
        if len(records) == 7:
            raise OSError("database gone")
        return BatchResult(done=len(records), applied=len(records))

    with pytest.raises(OSError, match="database gone"):
        await run(consumer, apply)
    assert consumer.commits == [{tp(0): 2}]


async def test_a_revoke_waits_for_the_fetch_in_flight() -> None:
    """The rebalance listener's revoke waits until the fetch's database work and its offset
    commit are done, then finds nothing left to commit."""
    gate = anyio.Event()
    consumer = FakeConsumer([{tp(0): recs(0, 3)}])
    revoked_after: list[list[dict[TopicPartition, int]]] = []

    async def apply(records: list[Rec]) -> BatchResult:
        await gate.wait()
        return BatchResult(done=len(records), applied=len(records))

    async def revoke() -> None:
        await consumer.listener.on_partitions_revoked({tp(0)})
        revoked_after.append(list(consumer.commits))

    async def loop() -> None:
        with pytest.raises(_Stop):
            await run(consumer, apply)

    async with anyio.create_task_group() as tg:
        tg.start_soon(loop)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(revoke)
        await anyio.wait_all_tasks_blocked()
        assert revoked_after == []  # still waiting for the batch in flight
        gate.set()
    assert revoked_after == [[{tp(0): 3}]]
