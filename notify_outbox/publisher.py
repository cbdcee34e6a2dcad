"""Publishing claimed rows to Kafka.

``Publisher`` is the port the relay's logic talks to; ``KafkaPublisher`` implements it with an
idempotent aiokafka producer (acks=all). A batch is pipelined: every ``send()`` is queued
first, then all acknowledgements are awaited together under one deadline, because aiokafka
with idempotence never expires a batch on its own and would wait forever for a dead broker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka import errors as kafka_errors
from aiokafka.helpers import create_ssl_context

from .backoff import Backoff
from .debezium import debezium_headers
from .enqueue import RESERVED_HEADERS
from .settings import OutboxSettings
from .store import OutboxRow
from .tracing import record_send_spans

__all__ = [
    "KafkaMessage",
    "KafkaPublisher",
    "PublishResult",
    "Publisher",
    "RowRejected",
    "to_message",
]

log = logging.getLogger("notify_outbox.publisher")

# Errors about one message that will not go away by retrying the batch at once; the row is
# retried with backoff and dead-lettered after max_attempts.
_ROW_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordTooLargeError,
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.InvalidTopicError,
    kafka_errors.CorruptRecordException,
    kafka_errors.UnsupportedForMessageFormatError,
)


# The idempotent producer's session is broken, not a row: after a batch expired while its
# partition had no leader (a broker restart), aiokafka has used up sequence numbers it never
# sent, and the broker refuses every later batch of that partition. Only a new producer
# (a new producer id) recovers; the rows stay pending and are sent again by it.
_SESSION_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.OutOfOrderSequenceNumber,
    kafka_errors.UnknownProducerId,
    kafka_errors.InvalidProducerEpoch,
    kafka_errors.ProducerFenced,
)


class _Abandoned(kafka_errors.KafkaError):  # type: ignore[misc]  # aiokafka has no type hints
    """What the records an abandoned producer still held fail with: they were never sent."""


# While acks are awaited (the claim's transaction is open), Kafka is asked this often whether it
# is still there; when it is not, the batch gives up at once rather than hold its row locks and
# an xid (which holds back vacuum cluster-wide) for the whole send deadline.
_PROBE_EVERY = 0.5
_PROBE_TIMEOUT = 1.0
# How often an unavailable Kafka is asked whether it is back: a refused connection costs
# nothing, and delivery should resume well within a second of the broker's return.
_RECOVERY_FIRST = 0.02
_RECOVERY_CAP = 0.2


class RowRejected(Exception):
    """The row can never become a Kafka message as stored (e.g. malformed headers)."""


@dataclass(frozen=True, slots=True)
class KafkaMessage:
    """A row mapped to what Kafka receives."""

    topic: str
    key: bytes | None
    value: bytes | None
    # A None value is a header with a null value (Debezium mode sends them for NULL columns).
    headers: Sequence[tuple[str, bytes | None]]


def to_message(row: OutboxRow, *, header_style: str = "native") -> KafkaMessage:
    """Map an outbox row to a Kafka message: ``payload`` JSON (or ``payload_bytes``) becomes
    the value, ``key`` the key, ``headers`` plus the event metadata the headers.

    ``header_style="debezium"``: the headers are the row's own, ``id`` first, and nothing of
    the relay's (what Debezium's outbox event router sends; see ``debezium.py``)."""
    if row.payload_bytes is not None:
        value: bytes | None = row.payload_bytes
    elif row.payload is not None:
        value = row.payload.encode()
    else:
        value = None
    key = row.key.encode() if row.key is not None else None
    if header_style == "debezium":
        # The router sends a null key with a null value too (not a tombstone to refuse).
        return KafkaMessage(row.topic, key, value, debezium_headers(row.headers))
    if value is None and key is None:
        raise RowRejected("event has neither a payload nor a key")
    headers: list[tuple[str, bytes]] = []
    if row.headers is not None:
        parsed = json.loads(row.headers)
        if not isinstance(parsed, dict):
            raise RowRejected("headers must be a JSON object")
        for name, val in parsed.items():
            if not isinstance(val, str):
                raise RowRejected(f"header {name!r} must have a string value")
            if name in RESERVED_HEADERS:
                raise RowRejected(f"header {name!r} is reserved for the relay")
            headers.append((name, val.encode()))
    headers.append(("outbox-event-id", str(row.event_id).encode()))
    for name, meta in (
        ("outbox-event-type", row.event_type),
        ("outbox-aggregate-type", row.aggregate_type),
        ("outbox-aggregate-id", row.aggregate_id),
    ):
        if meta is not None:
            headers.append((name, meta.encode()))
    return KafkaMessage(row.topic, key, value, headers)


@dataclass
class PublishResult:
    """Per-row outcome of one batch. Rows in no list were not sent (held back behind a failed
    row of their key, or not reached because Kafka became unavailable)."""

    delivered: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)  # retry with backoff
    rejected: list[tuple[int, str]] = field(default_factory=list)  # can never be sent
    unavailable: str | None = None  # Kafka trouble: back off before claiming again


class Publisher(Protocol):
    """What the relay needs from Kafka (a port, so tests can use a fake)."""

    @property
    def available(self) -> bool:
        """False while Kafka is known to be unavailable: claim nothing until
        ``wait_available`` returns."""
        ...

    async def publish(self, rows: Sequence[OutboxRow]) -> PublishResult:
        """Send rows in order and wait for their acks, within the send deadline."""
        ...

    async def wait_available(self) -> None:
        """Return once Kafka answers again and no earlier send is still in flight."""
        ...

    async def check(self) -> bool:
        """Ask Kafka whether it still answers (a relay with nothing to send would otherwise
        learn of an outage only at its next publish). False: it counts as unavailable, as
        after a failed publish, until ``wait_available`` returns."""
        ...


def _is_row_error(error: BaseException) -> bool:
    return isinstance(error, _ROW_ERRORS)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".rstrip(": ")


class KafkaPublisher:
    """``Publisher`` on one idempotent aiokafka producer, shared by all workers of a relay."""

    def __init__(self, settings: OutboxSettings) -> None:
        self._settings = settings
        self._producer: AIOKafkaProducer | None = None
        # Acks of batches whose deadline passed: they may still complete when Kafka returns.
        self._outstanding: set[asyncio.Future[Any]] = set()
        self._broken = False  # the producer's idempotent session is unusable: replace it
        self._down: str | None = None  # why Kafka is unavailable, while it is
        self._recovery_lock = asyncio.Lock()

    @property
    def available(self) -> bool:
        return self._down is None and not self._broken

    def _make_producer(self) -> AIOKafkaProducer:
        s = self._settings
        ssl_context = None
        if s.kafka_security_protocol in ("SSL", "SASL_SSL"):
            ssl_context = create_ssl_context(
                cafile=str(s.kafka_ssl_cafile) if s.kafka_ssl_cafile else None,
                certfile=str(s.kafka_ssl_certfile) if s.kafka_ssl_certfile else None,
                keyfile=str(s.kafka_ssl_keyfile) if s.kafka_ssl_keyfile else None,
                password=s.kafka_ssl_password.get_secret_value() if s.kafka_ssl_password else None,
            )
        return AIOKafkaProducer(
            bootstrap_servers=s.kafka_bootstrap_servers.split(","),
            client_id=s.kafka_client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=s.kafka_linger_ms,
            max_request_size=s.kafka_max_request_size,
            request_timeout_ms=s.kafka_request_timeout_ms,
            compression_type=s.kafka_compression_type,
            security_protocol=s.kafka_security_protocol,
            sasl_mechanism=s.kafka_sasl_mechanism or "PLAIN",
            sasl_plain_username=s.kafka_sasl_username,
            sasl_plain_password=(
                s.kafka_sasl_password.get_secret_value() if s.kafka_sasl_password else None
            ),
            ssl_context=ssl_context,
        )

    async def start(self) -> None:
        """Connect to Kafka, retrying with backoff until it answers (a relay started before
        its broker waits instead of crashing)."""
        s = self._settings
        backoff = Backoff(s.reconnect_min_delay, s.reconnect_max_delay)
        while True:
            producer = self._make_producer()
            try:
                with anyio.fail_after(s.kafka_send_timeout):
                    await producer.start()
            except (kafka_errors.KafkaError, TimeoutError, OSError) as e:
                with anyio.move_on_after(s.kafka_send_timeout, shield=True):
                    await producer.stop()
                delay = backoff.next_delay()
                # A relay started before its broker waits quietly: the first failure and one
                # in 64 as warnings, every attempt at DEBUG.
                log.log(
                    logging.WARNING if backoff.failures % 64 == 1 else logging.DEBUG,
                    "Kafka not reachable yet (%s); retrying every %.1fs or so",
                    _describe(e),
                    backoff.cap,
                )
                await anyio.sleep(delay)
                continue
            self._producer = producer
            return

    async def stop(self, grace: float) -> bool:
        """Flush and stop the producer within ``grace`` seconds; False if it was abandoned.

        Cancelling the caller (an abort during a graceful stop) abandons it at once."""
        producer, self._producer = self._producer, None
        if producer is None:
            return True
        stopped = False
        try:
            with anyio.move_on_after(grace):
                await producer.stop()
                stopped = True
        finally:
            if not stopped:
                _abandon(producer)
        if not stopped:
            log.error("Kafka producer did not stop within %.1fs; abandoning it", grace)
        return stopped

    @property
    def producer(self) -> AIOKafkaProducer:
        """The running producer."""
        if self._producer is None:
            raise RuntimeError("KafkaPublisher is not started")
        return self._producer

    async def _missing_topics(self, topics: set[str]) -> set[str]:
        """Topics Kafka says do not exist. Raises TimeoutError or KafkaError when Kafka cannot
        be asked, so that a broker outage is never mistaken for a missing topic."""
        client = self.producer.client
        unknown = {t for t in topics if client.cluster.partitions_for_topic(t) is None}
        if not unknown:
            return set()
        for topic in unknown:
            client.add_topic(topic)
        if not await client.force_metadata_update():
            raise kafka_errors.KafkaConnectionError("metadata request failed")
        return {t for t in unknown if client.cluster.partitions_for_topic(t) is None}

    async def _reachable(self, topics: Iterable[str] = ()) -> bool:
        """Whether Kafka answers a metadata request within ``_PROBE_TIMEOUT`` and every
        partition of ``topics`` (those that exist) has a leader to take writes."""
        client = self.producer.client
        with anyio.move_on_after(_PROBE_TIMEOUT):
            try:
                if not await client.force_metadata_update():
                    return False
            except (kafka_errors.KafkaError, OSError):
                return False
            for topic in topics:
                for partition in client.cluster.partitions_for_topic(topic) or ():
                    leader = client.cluster.leader_for_partition(TopicPartition(topic, partition))
                    if leader is None or leader < 0:
                        return False
            return True
        return False

    async def _await_acks(self, futures: Iterable[asyncio.Future[Any]], topics: set[str]) -> bool:
        """Wait for ``futures``; False as soon as a probe finds Kafka unavailable."""
        pending = {f for f in futures if not f.done()}
        while pending:
            _, pending = await asyncio.wait(pending, timeout=_PROBE_EVERY)
            if pending and not await self._reachable(topics):
                return False
        return True

    async def publish(self, rows: Sequence[OutboxRow]) -> PublishResult:
        started = time.time_ns()
        result = await self._publish(rows)
        record_send_spans(rows, result, started)  # OpenTelemetry, if on (tracing.py)
        return result

    async def _publish(self, rows: Sequence[OutboxRow]) -> PublishResult:
        result = PublishResult()
        if not self.available:
            result.unavailable = self._down or "the Kafka producer must be replaced"
            return result
        # One producer for the whole claim: records of one key must not be split between an
        # abandoned producer (which sends nothing more) and its replacement.
        producer = self.producer
        on_ack = self._watch(producer)
        sent: list[tuple[OutboxRow, asyncio.Future[Any]]] = []
        blocked_keys: set[str] = set()
        # The topic and ack of each key's latest row sent in this batch.
        latest: dict[str, tuple[str, asyncio.Future[Any]]] = {}
        topics = {r.topic for r in rows}

        def fail(row: OutboxRow, reason: str, *, permanent: bool) -> None:
            (result.rejected if permanent else result.failed).append((row.id, reason))
            # Later rows of this key must not overtake it: hold them back in this batch.
            if row.key is not None:
                blocked_keys.add(row.key)

        with anyio.move_on_after(self._settings.kafka_send_timeout) as scope:
            try:
                missing = await self._missing_topics(topics)
            except (kafka_errors.KafkaError, OSError) as e:
                result.unavailable = f"Kafka metadata unavailable: {_describe(e)}"
                missing = topics
            for row in rows:
                if result.unavailable is not None:
                    break
                if row.key is not None and row.key in blocked_keys:
                    continue
                if row.topic in missing:
                    fail(row, f"topic {row.topic!r} does not exist in Kafka", permanent=False)
                    continue
                try:
                    msg = to_message(row, header_style=self._settings.header_style)
                except (RowRejected, ValueError) as e:
                    fail(row, f"malformed event: {e}", permanent=True)
                    continue
                earlier = latest.get(row.key) if row.key is not None else None
                if earlier is not None and earlier[0] != row.topic:
                    # Kafka keeps order only within a partition: a key's row for another
                    # topic waits until the row before it is acknowledged (or failed).
                    if not await self._await_acks([earlier[1]], topics):
                        result.unavailable = "Kafka stopped answering"
                        break
                    if earlier[1].cancelled() or earlier[1].exception() is not None:
                        assert row.key is not None
                        blocked_keys.add(row.key)
                        continue
                try:
                    fut = await producer.send(
                        msg.topic, value=msg.value, key=msg.key, headers=msg.headers
                    )
                except kafka_errors.KafkaError as e:
                    if isinstance(e, _Abandoned):
                        break  # the rest stays pending for the next producer
                    if _is_row_error(e):
                        fail(row, _describe(e), permanent=False)
                        continue
                    result.unavailable = _describe(e)
                    break
                fut.add_done_callback(on_ack)
                sent.append((row, fut))
                if row.key is not None:
                    latest[row.key] = (row.topic, fut)
            if (
                sent
                and result.unavailable is None
                and not await self._await_acks([f for _, f in sent], topics)
            ):
                result.unavailable = "Kafka stopped answering"
        if scope.cancelled_caught and result.unavailable is None:
            result.unavailable = (
                f"Kafka did not acknowledge within {self._settings.kafka_send_timeout}s"
            )
        for row, fut in sent:
            if not fut.done():
                self._outstanding.add(fut)
                fut.add_done_callback(self._outstanding.discard)
                # Nobody awaits it any more: read its error when it comes, or asyncio logs
                # "exception was never retrieved" for each one.
                fut.add_done_callback(_retrieve)
                continue
            error = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
            if error is None:
                result.delivered.append(row.id)
            elif isinstance(error, _Abandoned):
                pass  # never sent: stays pending, no attempt counted
            elif isinstance(error, _SESSION_ERRORS):
                self._broken = True
                if result.unavailable is None:
                    result.unavailable = f"Kafka producer session broken: {_describe(error)}"
            elif _is_row_error(error) or (
                isinstance(error, kafka_errors.KafkaError) and not error.retriable
            ):
                fail(row, _describe(error), permanent=False)
            elif result.unavailable is None:
                result.unavailable = _describe(error)
        if result.unavailable is not None and self._down is None:
            self._down = result.unavailable
        return result

    def _watch(self, producer: AIOKafkaProducer) -> Callable[[asyncio.Future[Any]], None]:
        """A done-callback for ``producer``'s acks: the first record that fails abandons it.

        aiokafka numbers a partition's record batches when it sends them and never takes a
        number back, so a batch the broker refused (a record over the topic's
        ``max.message.bytes``, say) leaves a gap, and aiokafka still sends the partition's next
        batch. The broker refuses that one (OutOfOrderSequenceNumber) only if it holds state
        for this producer on the partition; if the refused batch was the producer's first
        there, it appends it, and a key's later rows are in Kafka before its failed row. This
        callback is scheduled when the record's future fails, before aiokafka's sender is woken
        to send the next batch, so abandoning the producer here stops it in time: its unsent
        records fail with ``_Abandoned`` and stay pending for the next producer.
        """

        def on_ack(fut: asyncio.Future[Any]) -> None:
            error = None if fut.cancelled() else fut.exception()
            if error is None or isinstance(error, _Abandoned):
                return
            if producer is self._producer and not self._broken:
                self._broken = True
                log.warning(
                    "a record failed at Kafka (%s); replacing the producer so that nothing "
                    "queued behind it is sent out of order",
                    _describe(error),
                )
            _abandon(producer)

        return on_ack

    async def _replace(self) -> None:
        """Start a new producer and abandon the old one without waiting for its sends.

        Its unacknowledged sends belong to claims that were given back: their rows are sent
        again by the new producer (at-least-once). A new producer id also leaves behind an
        idempotent session that a broker restart may have broken (sequence numbers the
        broker no longer expects), instead of discovering that through a failed send.
        """
        old = self._producer
        await self.start()
        self._broken = False
        self._outstanding.clear()
        if old is not None:
            # Without its sender task, stop() does not wait to flush what it still holds.
            _abandon(old)
            with anyio.move_on_after(_PROBE_TIMEOUT, shield=True):
                await old.stop()

    async def check(self) -> bool:
        if not self.available:
            return False
        if await self._reachable():
            return True
        self._down = self._down or "Kafka stopped answering"
        return False

    async def wait_available(self) -> None:
        async with self._recovery_lock:  # one prober for all workers
            if self.available:
                return
            backoff = Backoff(_RECOVERY_FIRST, _RECOVERY_CAP)
            while not await self._reachable():
                await backoff.sleep()
            if self._broken or any(not f.done() for f in self._outstanding):
                await self._replace()
            self._down = None


def _abandon(producer: AIOKafkaProducer) -> None:
    """Cancel a producer's sender task, so nothing it still holds is sent; once the task has
    ended (after the requests already sent), fail what it still holds with ``_Abandoned``,
    so that nobody waits for those acks."""
    sender_task = getattr(getattr(producer, "_sender", None), "sender_task", None)
    if sender_task is not None and not sender_task.done() and not sender_task.cancelling():
        sender_task.cancel()
        accumulator = getattr(producer, "_message_accumulator", None)
        if accumulator is None:
            return

        def fail_unsent(_: object) -> None:
            queued = [batch for batches in accumulator._batches.values() for batch in batches]
            # Later send() calls raise it too, and a send() waiting for room in a full batch
            # returns at once instead of after request_timeout_ms.
            accumulator.fail_all(_Abandoned("the Kafka producer was abandoned"))
            for batch in queued:
                _retrieve(batch._drain_waiter)  # or asyncio logs it as never retrieved

        sender_task.add_done_callback(fail_unsent)
