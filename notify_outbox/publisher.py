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
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors
from aiokafka.helpers import create_ssl_context

from .claimer import OutboxRow
from .enqueue import RESERVED_HEADERS
from .settings import OutboxSettings

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


class RowRejected(Exception):
    """The row can never become a Kafka message as stored (e.g. malformed headers)."""


@dataclass(frozen=True, slots=True)
class KafkaMessage:
    """A row mapped to what Kafka receives."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


def to_message(row: OutboxRow) -> KafkaMessage:
    """Map an outbox row to a Kafka message: ``payload`` JSON (or ``payload_bytes``) becomes
    the value, ``key`` the key, ``headers`` plus the event metadata the headers."""
    if row.payload_bytes is not None:
        value: bytes | None = row.payload_bytes
    elif row.payload is not None:
        value = row.payload.encode()
    else:
        value = None
    key = row.key.encode() if row.key is not None else None
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

    async def publish(self, rows: Sequence[OutboxRow]) -> PublishResult:
        """Send rows in order and wait for their acks, within the send deadline."""
        ...

    async def wait_available(self) -> None:
        """Return once Kafka answers again and no earlier send is still in flight."""
        ...


def _is_row_error(error: BaseException) -> bool:
    return isinstance(error, _ROW_ERRORS)


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
        self._restart_lock = asyncio.Lock()

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
        delay = self._settings.reconnect_min_delay
        while True:
            producer = self._make_producer()
            try:
                with anyio.fail_after(self._settings.kafka_send_timeout):
                    await producer.start()
            except (kafka_errors.KafkaError, TimeoutError, OSError) as e:
                with anyio.move_on_after(self._settings.kafka_send_timeout, shield=True):
                    await producer.stop()
                log.warning("Kafka not reachable yet (%s); retrying in %.1fs", _describe(e), delay)
                await anyio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, self._settings.reconnect_max_delay)
                continue
            self._producer = producer
            return

    async def stop(self, grace: float) -> bool:
        """Flush and stop the producer within ``grace`` seconds; False if it was abandoned."""
        producer, self._producer = self._producer, None
        if producer is None:
            return True
        with anyio.move_on_after(grace, shield=True) as scope:
            await producer.stop()
        if scope.cancelled_caught:
            log.error("Kafka producer did not stop within %.1fs; abandoning it", grace)
            return False
        return True

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

    async def publish(self, rows: Sequence[OutboxRow]) -> PublishResult:
        result = PublishResult()
        sent: list[tuple[OutboxRow, asyncio.Future[Any]]] = []
        blocked_keys: set[str] = set()

        def fail(row: OutboxRow, reason: str, *, permanent: bool) -> None:
            (result.rejected if permanent else result.failed).append((row.id, reason))
            # Later rows of this key must not overtake it: hold them back in this batch.
            if row.key is not None:
                blocked_keys.add(row.key)

        with anyio.move_on_after(self._settings.kafka_send_timeout) as scope:
            try:
                missing = await self._missing_topics({r.topic for r in rows})
            except (kafka_errors.KafkaError, OSError) as e:
                result.unavailable = f"Kafka metadata unavailable: {_describe(e)}"
                return result
            for row in rows:
                if row.key is not None and row.key in blocked_keys:
                    continue
                if row.topic in missing:
                    fail(row, f"topic {row.topic!r} does not exist in Kafka", permanent=False)
                    continue
                try:
                    msg = to_message(row)
                except (RowRejected, ValueError) as e:
                    fail(row, f"malformed event: {e}", permanent=True)
                    continue
                try:
                    fut = await self.producer.send(
                        msg.topic, value=msg.value, key=msg.key, headers=msg.headers
                    )
                except kafka_errors.KafkaError as e:
                    if _is_row_error(e):
                        fail(row, _describe(e), permanent=False)
                        continue
                    result.unavailable = _describe(e)
                    break
                sent.append((row, fut))
            if sent:
                await asyncio.wait([f for _, f in sent])
        if scope.cancelled_caught and result.unavailable is None:
            result.unavailable = (
                f"Kafka did not acknowledge within {self._settings.kafka_send_timeout}s"
            )
        for row, fut in sent:
            if not fut.done():
                self._outstanding.add(fut)
                fut.add_done_callback(self._outstanding.discard)
                continue
            error = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
            if error is None:
                result.delivered.append(row.id)
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
        return result

    async def _restart(self) -> None:
        """Replace a producer whose session is broken (see ``_SESSION_ERRORS``)."""
        async with self._restart_lock:
            if not self._broken:
                return
            log.warning("restarting the Kafka producer: its idempotent session is broken")
            old = self._producer
            await self.start()  # the old producer serves other workers until this returns
            self._broken = False
            self._outstanding.clear()
            if old is not None:
                with anyio.move_on_after(self._settings.kafka_send_timeout, shield=True):
                    await old.stop()

    async def wait_available(self) -> None:
        if self._broken:
            await self._restart()
        delay = self._settings.reconnect_min_delay
        while True:
            pending = [f for f in self._outstanding if not f.done()]
            if pending:
                await asyncio.wait(pending, timeout=delay)
            else:
                with anyio.move_on_after(self._settings.kafka_send_timeout):
                    if await self.producer.client.force_metadata_update():
                        return
            log.info("waiting for Kafka to come back (next check in %.1fs)", delay)
            await anyio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self._settings.reconnect_max_delay)
