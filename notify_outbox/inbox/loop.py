"""The Kafka loop: ``consume`` and ``consume_batches`` run an aiokafka consumer through an
``Inbox``, one transaction per fetched partition batch, offsets committed after the database
commit, with a rebalance listener (``InboxRebalanceListener``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import asyncpg
from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka import errors as kafka_errors

from notify_outbox.core.errors import ConfigurationError

from .core import (
    BatchHandler,
    BatchResult,
    Inbox,
    MessageHandler,
    OnError,
    _refuse_open_transaction,
)
from .errors import InboxError

#: A record value's decoder for the consume loops (plain or async): bytes (or None) in,
#: the value the handler sees out.
Deserializer = Callable[[bytes | None], Any]

__all__ = [
    "InboxRebalanceListener",
    "consume",
    "consume_batches",
]

log = logging.getLogger("notify_outbox.inbox")


class InboxRebalanceListener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Commits what is done when partitions are revoked, so a rebalance does not hand a
    whole batch to the partitions' next owner.

    ``consume(..., topics=[...])`` and ``consume_batches`` subscribe the consumer with one
    (aiokafka sets a listener only through ``subscribe``). To subscribe yourself (a pattern,
    say), pass ``InboxRebalanceListener()`` to ``subscribe(..., listener=...)`` and the same
    object to ``consume(..., listener=...)``.

    ``chain``: a listener of your own (any aiokafka ``ConsumerRebalanceListener``, its methods
    plain or ``async``), called after this one's work: on revoke, once the batch in flight is
    committed; on assign, after this one. Its errors propagate (aiokafka logs them).

    On revoke it waits (up to ``timeout`` seconds) for the partition batch in flight to
    commit in the database, then commits its Kafka offset, before the group moves on.
    """

    def __init__(
        self, timeout: float = 30.0, *, chain: ConsumerRebalanceListener | None = None
    ) -> None:
        if chain is not None and not isinstance(chain, ConsumerRebalanceListener):
            raise ConfigurationError("chain must be an aiokafka ConsumerRebalanceListener")
        self.timeout = timeout
        self.chain = chain
        self.consumer: Any = None
        self._idle = anyio.Event()
        self._idle.set()
        self._pending: dict[TopicPartition, int] = {}
        # Revoked and not assigned again yet: aiokafka keeps the old assignment until the
        # group has a new one, so the loop must not start a batch of these meanwhile.
        self.revoked: set[TopicPartition] = set()

    def _busy(self) -> None:
        if self._idle.is_set():
            self._idle = anyio.Event()

    def _done(self) -> None:
        self._idle.set()

    async def on_partitions_revoked(self, revoked: Any) -> None:
        """Wait for the batch in flight, then commit the revoked partitions' done offsets;
        then the chained listener's ``on_partitions_revoked``."""
        self.revoked.update(revoked)
        with anyio.move_on_after(self.timeout):
            await self._idle.wait()
        offsets = {tp: o for tp, o in self._pending.items() if tp in set(revoked)}
        if offsets and self.consumer is not None:
            await _commit(self.consumer, offsets)
        for tp in revoked:
            self._pending.pop(tp, None)
        if self.chain is not None:
            await _maybe_await(self.chain.on_partitions_revoked(revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        """The new assignment: its partitions' batches may run again (from the committed
        offsets, where aiokafka resumes); then the chained listener's
        ``on_partitions_assigned``."""
        self.revoked.difference_update(assigned)
        if self.chain is not None:
            await _maybe_await(self.chain.on_partitions_assigned(assigned))


async def _maybe_await(result: Any) -> None:
    # aiokafka accepts listeners with plain or async methods; so does the chain.
    if inspect.isawaitable(result):
        await result


async def consume(
    consumer: Any,
    db: asyncpg.Pool | asyncpg.Connection,
    handler: MessageHandler,
    *,
    inbox: Inbox,
    max_records: int = 500,
    poll_timeout: float = 0.5,
    on_error: OnError = "stop",
    topics: Sequence[str] | None = None,
    listener: ConsumerRebalanceListener | None = None,
    concurrency: int = 1,
    deserializer: Deserializer | None = None,
) -> None:
    """Run an aiokafka consumer through the inbox until cancelled, one message at a time for
    the handler: ``handler(conn, message)`` for each fresh message.

    ``consumer`` is a started ``AIOKafkaConsumer`` with ``enable_auto_commit=False`` and a
    ``group_id``. Each fetched partition batch is one transaction (``Inbox.apply_each``): its
    ids claimed in one statement, the handler run for the fresh messages in order; then the
    offsets of the fetch's partitions are committed, in one request. A crash anywhere in
    between only causes redeliveries, which the inbox skips. A handler error: see
    ``on_error`` in ``Inbox.apply_each``; with ``"stop"`` the offsets of the messages before it
    (and of the fetch's other partitions) are committed, then ``HandlerFailed`` propagates
    (the handler's error is its ``__cause__``).

    Rebalances: with ``topics``, ``consume`` subscribes the consumer to them (replacing any
    earlier subscription) with an ``InboxRebalanceListener``, which commits the batch in
    flight when partitions are revoked. ``listener``, a ``ConsumerRebalanceListener`` of your
    own, is chained to it (an ``InboxRebalanceListener`` is used as it is). Without
    ``topics``, the consumer must be subscribed already: pass the ``InboxRebalanceListener``
    it was subscribed with as ``listener``. With neither, a rebalance hands the batch in
    flight to the next owner again (the inbox skips it; a warning says so).

    ``concurrency`` (with a pool): how many partitions' batches of one fetch run at once, each
    in its own transaction on its own connection. Order within a partition is kept (one batch
    per partition at a time); the handler may then run for different partitions
    concurrently, so it must not rely on the order between partitions, which Kafka does not
    give anyway. Default 1: one batch after the other.

    ``deserializer``: called with each record's value (bytes, or None), plain or async; the
    handler sees its result as ``message.value``. For records of a Schema Registry,
    ``notify_outbox.schemaregistry.RegistryDeserializer``. A value it cannot decode stops the
    loop with its error, before that batch's transaction (nothing of it is applied).
    """
    await _consume(
        consumer,
        db,
        lambda records: inbox.apply_each(db, records, handler, on_error=on_error),
        max_records=max_records,
        poll_timeout=poll_timeout,
        topics=topics,
        listener=listener,
        concurrency=concurrency,
        deserializer=deserializer,
    )


async def consume_batches(
    consumer: Any,
    db: asyncpg.Pool | asyncpg.Connection,
    handler: BatchHandler,
    *,
    inbox: Inbox,
    max_records: int = 500,
    poll_timeout: float = 0.5,
    on_error: OnError = "stop",
    topics: Sequence[str] | None = None,
    listener: ConsumerRebalanceListener | None = None,
    concurrency: int = 1,
    deserializer: Deserializer | None = None,
) -> None:
    """``consume`` for a batch handler: ``handler(conn, fresh_messages)`` once per fetched
    partition batch, with only the messages not applied before (``Inbox.apply_batch``), so it
    can write them in one statement. The offsets move after the database commit. ``topics``,
    ``listener``, ``concurrency`` and ``deserializer``: as in ``consume``."""
    await _consume(
        consumer,
        db,
        lambda records: inbox.apply_batch(db, records, handler, on_error=on_error),
        max_records=max_records,
        poll_timeout=poll_timeout,
        topics=topics,
        listener=listener,
        concurrency=concurrency,
        deserializer=deserializer,
    )


async def _decoded(records: list[Any], deserializer: Deserializer) -> list[Any]:
    """The records with their values decoded (aiokafka's records are mutable dataclasses;
    copies, so that the consumer's own are untouched)."""
    out = []
    for record in records:
        value = deserializer(record.value)
        if inspect.isawaitable(value):
            value = await value
        out.append(dataclasses.replace(record, value=value))
    return out


async def _consume(
    consumer: Any,
    db: asyncpg.Pool | asyncpg.Connection,
    apply: Callable[[list[Any]], Awaitable[BatchResult]],
    *,
    max_records: int,
    poll_timeout: float,
    topics: Sequence[str] | None,
    listener: ConsumerRebalanceListener | None,
    concurrency: int,
    deserializer: Deserializer | None = None,
) -> None:
    if getattr(consumer, "_enable_auto_commit", False):
        raise ConfigurationError(
            "the Kafka consumer must have enable_auto_commit=False: with auto-commit, offsets "
            "can move before the database commit and a crash loses messages"
        )
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigurationError("concurrency must be a whole number of at least 1")
    if concurrency > 1 and not isinstance(db, asyncpg.Pool):
        raise ConfigurationError(
            "concurrency > 1 needs an asyncpg pool: each partition's batch runs in its own "
            "transaction on its own connection"
        )
    if isinstance(db, asyncpg.Connection):
        _refuse_open_transaction(db)
    inbox_listener = _subscribe(consumer, topics, listener)
    limiter = anyio.CapacityLimiter(concurrency)

    async def one(
        tp: TopicPartition,
        records: list[Any],
        offsets: dict[TopicPartition, int],
        errors: list[Exception],
    ) -> None:
        async with limiter:
            if tp not in consumer.assignment() or tp in inbox_listener.revoked:
                return  # revoked meanwhile: its next owner has it
            if deserializer is not None:
                records = await _decoded(records, deserializer)
            await _apply_partition(apply, tp, records, offsets, errors)

    while True:
        batch = await consumer.getmany(timeout_ms=int(poll_timeout * 1000), max_records=max_records)
        work = [(tp, records) for tp, records in batch.items() if records]
        if not work:
            continue
        # What each partition's batch got done: its offset to commit, or the error that
        # stopped it (with the offset of the messages before it, for an InboxError).
        offsets: dict[TopicPartition, int] = {}
        errors: list[Exception] = []
        # A revoke waits until this fetch's database commits and its offset commit are done
        # (the generation is still valid while the listener runs, so the commit counts).
        inbox_listener._busy()
        try:
            if concurrency == 1 or len(work) == 1:
                for tp, records in work:
                    await one(tp, records, offsets, errors)
                    if errors:
                        break  # the partitions after it are not started: their offsets stay
            else:
                # Partitions are independent (order is per partition, and a partition has one
                # batch in flight): their transactions overlap on the pool's connections.
                async with anyio.create_task_group() as tg:
                    for tp, records in work:
                        tg.start_soon(one, tp, records, offsets, errors)
            # One offset commit per fetch, after every database commit it covers.
            inbox_listener._pending.update(offsets)  # for a revoke, if this commit fails
            if errors:
                with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                    await _commit(consumer, offsets)
                raise errors[0]
            await _commit(consumer, offsets)
            for tp in offsets:
                inbox_listener._pending.pop(tp, None)
        finally:
            inbox_listener._done()


async def _apply_partition(
    apply: Callable[[list[Any]], Awaitable[BatchResult]],
    tp: TopicPartition,
    records: list[Any],
    offsets: dict[TopicPartition, int],
    errors: list[Exception],
) -> None:
    """One partition's batch: records in ``offsets`` the offset after what it got done, and
    in ``errors`` what stopped it."""
    try:
        result = await apply(records)
    except Exception as e:
        done = e.result.done if isinstance(e, InboxError) and e.result is not None else 0
        if done:
            offsets[tp] = records[done - 1].offset + 1
        errors.append(e)
        return
    if result.done:
        offsets[tp] = records[result.done - 1].offset + 1


def _subscribe(
    consumer: Any, topics: Sequence[str] | None, listener: ConsumerRebalanceListener | None
) -> InboxRebalanceListener:
    """The listener the loop reports its batches to. With ``topics``, the consumer is
    subscribed with it (aiokafka's public way to set a listener); without, it is the caller's
    (who subscribed with it), or one that no rebalance calls."""
    if isinstance(topics, str):
        raise ConfigurationError("topics must be a list of topic names, not one string")
    inbox_listener = (
        listener
        if isinstance(listener, InboxRebalanceListener)
        else InboxRebalanceListener(chain=listener)
    )
    if topics is not None:
        if not topics:
            raise ConfigurationError("topics must name at least one topic")
        consumer.subscribe(list(topics), listener=inbox_listener)
    elif listener is not None and inbox_listener is not listener:
        raise ConfigurationError(
            "a listener that is not an InboxRebalanceListener needs topics=: consume "
            "subscribes the consumer with it chained to the inbox's listener (or subscribe "
            "with InboxRebalanceListener(chain=your_listener) and pass that as listener=)"
        )
    elif listener is None:
        log.warning(
            "consume: no topics= and no listener=, so no rebalance listener: a rebalance hands "
            "the batch in flight to the next owner again (the inbox skips it). Pass topics= to "
            "consume, or subscribe with an InboxRebalanceListener and pass it as listener="
        )
    inbox_listener.consumer = consumer
    return inbox_listener


async def _commit(consumer: Any, offsets: dict[TopicPartition, int]) -> None:
    if not offsets:
        return
    try:
        await consumer.commit(offsets)
    except (kafka_errors.CommitFailedError, kafka_errors.IllegalStateError) as e:
        # A rebalance took the partitions away: their new owner gets these messages again
        # and the inbox skips them. Nothing is lost, so this is not an error of ours.
        log.warning(
            "offset commit after a rebalance failed (%s): the messages are redelivered "
            "and skipped by the inbox",
            type(e).__name__,
        )
