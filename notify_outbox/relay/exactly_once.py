"""The exactly-once relay: each committed event appears once to read_committed consumers.

Opt-in (``NOTIFY_OUTBOX_DELIVERY=exactly-once``); the design, its invariants and the faults
each one covers are in docs/concepts/exactly-once.md. In short, each worker holds a *slot*
(a row of ``<table>_eos_slot``, leased on the database's clock) with its own transactional
producer (``transactional.id`` = prefix + slot). A step of a slot is one database
transaction (``<table>_eos_step``): it settles the slot's previous batch and *stamps* the next
batch with (slot, sequence) before anything of it goes to Kafka. The batch then goes out in
one Kafka transaction together with a marker record (slot, sequence, ids) on a compacted
topic. Whoever takes a slot over (this relay after a restart, or another one after the lease
expired) first fences the slot's previous producer (``init_transactions`` with the same
transactional id ends its open transaction), then reads the slot's markers read_committed up
to the partition's high watermark: the one batch that can be outstanding is published if its
marker committed, given back if not. A batch whose commit's outcome is unknown (a timeout, a
broker lost mid-commit) is settled the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import secrets
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import aiokafka.producer.sender
import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka import errors as kafka_errors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from notify_outbox.core.backoff import Backoff
from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.events import RelayEvents
from notify_outbox.core.logs import redact
from notify_outbox.core.message import SCHEMA_REGISTRY, KafkaMessage, PublishResult
from notify_outbox.core.outbox import BatchOutcome, OutboxRow
from notify_outbox.core.settings import OutboxSettings
from notify_outbox.kafka.publisher import (
    KafkaPublisher,
    NotEncoded,
    Partitions,
    TokenProvider,
    missing_topics,
)
from notify_outbox.kafka.records import RowRejected, to_message
from notify_outbox.kafka.registry import RegistryError
from notify_outbox.pg.db import connect_worker_pool
from notify_outbox.pg.deadletters import DeadLetterFilter, purge, report_expired
from notify_outbox.pg.sqlfiles import Queries
from notify_outbox.pg.store import LowWaterMark

from .listener import Listener
from .outage import Outage, tame_third_party_logs
from .policy import decide
from .wakeup import Doorbell
from .wiring import require_schema

__all__ = ["ExactlyOnceRelay", "SlotLost", "marker_key"]

log = logging.getLogger("notify_outbox.exactly_once")

#: What the step function raises when the slot is no longer the caller's (migration 0007).
_SLOT_LOST_STATE = "NO001"
#: Errors of a Kafka transaction after which this producer must not be used again: another
#: producer with the slot's transactional id took over (fenced), or the client says so.
_FENCED: tuple[type[Exception], ...] = (
    kafka_errors.ProducerFenced,
    kafka_errors.InvalidProducerEpoch,
    kafka_errors.TransactionalIdAuthorizationFailed,
)
#: A record that Kafka refuses by itself: the row's own failure (retried, then dead-lettered).
_ROW_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordTooLargeError,
    kafka_errors.InvalidTopicError,
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.CorruptRecordException,
    kafka_errors.UnsupportedForMessageFormatError,
)

#: What a database statement raises when PostgreSQL is unreachable or the session broke
#: (TimeoutError is an OSError); with Kafka's errors, what a worker retries after a pause.
_DATABASE_ERRORS: tuple[type[Exception], ...] = (
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
)
_TRANSIENT: tuple[type[Exception], ...] = (*_DATABASE_ERRORS, kafka_errors.KafkaError)

#: A worker whose step stamped at least this fraction of ``batch_size`` rings another idle
#: worker: under a backlog the slots work in parallel; below it one slot's transactions,
#: each taking what arrived during the last, carry the load (see ExactlyOnceRelay._on_wake).
_JOIN_FRACTION = 0.1

#: How a broker's refusal of a record batch over the topic's size limit is described.
_TOO_LARGE_NAMES = ("MessageSizeTooLargeError", "RecordTooLargeError")

FaultHook = Callable[[str], None]

#: How long aiokafka waits before it asks again to add the first partition of a transaction
#: that the coordinator refused with CONCURRENT_TRANSACTIONS, as it does for a few
#: milliseconds after each commit while it writes the previous transaction's markers
#: (KAFKA-5477). aiokafka waits 20 ms (its BACKOFF_OVERRIDE); a slot begins its next
#: transaction right after a commit, so under load most batches paid those 20 ms:
#: back-to-back transactions took 24 ms at the median instead of 2 (docs/benchmarks.md).
#: A retry is one small request to the coordinator.
CONCURRENT_TRANSACTIONS_BACKOFF = 0.002


def _shorten_concurrent_transactions_backoff() -> None:
    """Set aiokafka's wait after CONCURRENT_TRANSACTIONS (module-wide: it is a constant of
    its sender, read at each retry; only transactional producers ever use it)."""
    if hasattr(aiokafka.producer.sender, "BACKOFF_OVERRIDE"):
        aiokafka.producer.sender.BACKOFF_OVERRIDE = CONCURRENT_TRANSACTIONS_BACKOFF
    else:  # an aiokafka that no longer has it: slower under load, still correct
        log.debug("aiokafka has no BACKOFF_OVERRIDE; the 20 ms retry wait stays")


class SlotLost(Exception):
    """The slot is no longer this worker's (its lease was taken over, or its producer fenced):
    the worker lets it go, sends nothing more with it, and leases another."""


def marker_key(transactional_id: str) -> bytes:
    """The key of a slot's markers: its transactional id, unique in the Kafka cluster
    (compaction keeps each slot's last marker)."""
    return transactional_id.encode()


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".rstrip(": ")


def _jitter() -> float:
    return random.uniform(0.5, 1.0)


@dataclass
class _Settle:
    """How to settle a slot's batch at its next step."""

    seq: int
    committed: bool
    retry: list[tuple[int, str, float]] = field(default_factory=list)
    dead: list[tuple[int, str]] = field(default_factory=list)


class ExactlyOnceRelay:
    """Moves committed outbox rows to Kafka in transactions: a read_committed consumer sees
    each event once, in per-key commit order, whatever crashes, freezes or restarts happen.

    Use it as an async context manager, or call ``run()`` and ``request_stop()``; ``counters``
    counts transactions committed and aborted, fences, recoveries and leases. ``RelayMetrics``
    (``ops/metrics.py``) exports them, with ``/readyz``'s checks, as for the at-least-once
    relay. Events it emits, beyond the at-least-once relay's ``wake:*``, ``claimed``,
    ``published``, ``retried`` and ``dead_lettered``: ``eos_committed``, ``eos_aborted``
    (transactions), ``eos_fence`` (a slot's producer started), ``eos_leased``,
    ``eos_slot_lost``, ``eos_recovered_committed`` and ``eos_recovered_aborted`` (a batch in
    flight settled from the markers)."""

    def __init__(
        self,
        settings: OutboxSettings,
        *,
        fault_hook: FaultHook | None = None,
        kafka_token_provider: TokenProvider | None = None,
        trust_markers: bool = True,
    ) -> None:
        """``trust_markers=False`` is for the fault suite's control only: recovery then
        treats every batch in flight as not committed and sends it again, as a relay without
        a durable record of what it had sent would; the suite shows that this duplicates."""
        if settings.delivery != "exactly-once":
            raise ConfigurationError(
                "ExactlyOnceRelay needs NOTIFY_OUTBOX_DELIVERY=exactly-once in its settings"
            )
        self.settings = settings
        self.events = RelayEvents()
        self.counters: Counter[str] = Counter()
        self.relay_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        names = settings.names
        self._target = names.target
        self._q = Queries(names)
        self._kafka = KafkaPublisher(settings, token_provider=kafka_token_provider)
        # Set at start from the database's name unless configured (see _transactional_id).
        self._prefix = settings.eos_transactional_id_prefix or ""
        self._fault_hook = fault_hook
        self._trust_markers = trust_markers
        self._doorbell = Doorbell()
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()
        self._pool: asyncpg.Pool | None = None
        # Slots this relay's workers serve, each with the event its ticker sets once the
        # slot's lease was found taken over.
        self._serving: dict[int, asyncio.Event] = {}
        self._rescuing: asyncio.Task[None] | None = None
        # Workers between a step that stamped rows and their next wait (see _on_wake).
        self._cycling = 0
        # Each record's partition (Kafka's default rule), as the at-least-once publisher.
        self._partitions = Partitions()
        # Topics whose records go one per batch (see _too_large_batches).
        self._alone: set[str] = set()
        # Pause between batches aborted because Kafka was unavailable (reset by a commit).
        self._unavailable = Backoff(settings.reconnect_min_delay, settings.reconnect_max_delay)
        self._marker_partitions = 1
        self._lease_ms = max(1, round(settings.eos_lease * 1000))
        #: "running" until run() returns: "stopped" (asked to) or "failed" (an error ended it).
        self.outcome: Literal["running", "stopped", "failed"] = "running"
        #: PostgreSQL's and Kafka's state as this relay sees them: one log line when an outage
        #: starts and one when it ends, and /readyz's answer.
        self.db_outage = Outage("PostgreSQL", log)
        self.kafka_outage = Outage("Kafka", log)
        self.listener: Listener | None = None
        # Slots whose batch in flight is being settled from the markers (/readyz).
        self._recovering: set[int] = set()

    # --- life cycle ---------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether the relay is connected and its workers run."""
        return self._ready.is_set()

    async def wait_ready(self) -> None:
        """Return once the relay is ready (connected, the marker topic there)."""
        await self._ready.wait()

    @property
    def low_water_mark(self) -> LowWaterMark:
        """Where the table gauges' scans start: the start of the table (this relay keeps no
        mark)."""
        return LowWaterMark()

    def state_gauges(self) -> dict[str, float]:
        """This relay's own gauges for ``RelayMetrics`` (``ops/metrics.py``: STATE_GAUGES)."""
        return {
            "eos_slots_held": float(len(self._serving)),
            "eos_slots_recovering": float(len(self._recovering)),
        }

    def readiness_checks(self) -> dict[str, str]:
        """``/readyz``'s check of the slots: not ready while a batch in flight is being
        settled from the markers (its keys wait until then)."""
        if self._recovering:
            slots = ", ".join(str(n) for n in sorted(self._recovering))
            return {"slots": f"recovering slot {slots}: reading its markers to settle a batch"}
        return {"slots": "ok"}

    def request_stop(self) -> None:
        """Finish the batches in flight, settle them, let the slots go and return from run()."""
        self._stop.set()
        self._doorbell.close()

    async def __aenter__(self) -> ExactlyOnceRelay:
        self._task = asyncio.ensure_future(self.run())
        ready = asyncio.ensure_future(self._ready.wait())
        await asyncio.wait({self._task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            ready.cancel()
            self._task.result()  # raises what ended it
        return self

    async def __aexit__(self, *_: object) -> None:
        self.request_stop()
        await self._task

    async def run(self) -> None:
        """Run until ``request_stop()``."""
        try:
            with tame_third_party_logs():
                await self._run()
        except BaseException:
            self.outcome = "failed"
            raise

    async def _run(self) -> None:
        s = self.settings
        _shorten_concurrent_transactions_backoff()
        pool, _ = await connect_worker_pool(s, "notify-outbox-eos")
        self._pool = pool
        tasks: list[asyncio.Task[None]] = []
        try:
            await require_schema(pool, s)
            if not self._prefix:
                database = await pool.fetchval("SELECT current_database()")
                self._prefix = f"notify-outbox.{database}.{self._target}."
            await self._ensure_marker_topic()
            # A registry that refuses the relay is a setting to fix (ConfigurationError); one
            # that does not answer yet only holds back its topics' rows.
            await self._kafka.probe_registry()
            if not s.poll_only:
                self.listener = Listener(s, self._on_wake, self.events, notify=self._notify)
                tasks.append(asyncio.create_task(self.listener.run()))
            workers = min(s.workers, s.eos_slots)
            worker_tasks = [asyncio.create_task(self._worker(i)) for i in range(workers)]
            tasks += worker_tasks
            tasks.append(asyncio.create_task(self._ticker()))
            tasks.append(asyncio.create_task(self._housekeeping()))
            if self.listener is not None:
                # Ready once notifications can wake the workers, as the at-least-once relay.
                listening = asyncio.create_task(self.events.wait_for("listening"))
                try:
                    await asyncio.wait({listening, *tasks}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    listening.cancel()
                for task in tasks:
                    if task.done() and not task.cancelled() and (error := task.exception()):
                        raise error
            self._ready.set()
            self.events.emit("wake:start")
            log.info(
                "relay running (exactly-once): %s, %d workers, %d slots, transactional ids %s<n>",
                self.relay_id,
                workers,
                s.eos_slots,
                self._prefix,
            )
            # Until asked to stop; a task that fails ends the relay with its error (one that
            # has nothing to do, as retention with nothing kept, just ends).
            stop = asyncio.create_task(self._stop.wait())
            watched: set[asyncio.Task[Any]] = {stop, *tasks}
            while not stop.done():
                done, watched = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t is not stop and not t.cancelled() and (error := t.exception()):
                        stop.cancel()
                        raise error
            self.request_stop()
            # Workers finish their batch and settle it; the rest is cancelled.
            await asyncio.wait(worker_tasks, timeout=s.shutdown_timeout)
            self.outcome = "stopped"
        finally:
            if self._rescuing is not None:
                tasks.append(self._rescuing)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await pool.close()
            if self._kafka.encoder is not None:
                await self._kafka.encoder.client.aclose()

    def _transactional_id(self, slot: int) -> str:
        """The slot's transactional.id. It must be unique to this outbox in the Kafka
        cluster: two outboxes sharing one would fence each other and read each other's
        markers (whose key it is)."""
        return f"{self._prefix}{slot}"

    def _on_wake(self, source: str) -> None:
        self.events.emit(f"wake:{source}")
        if self._cycling:
            # A worker is in the middle of a batch: it steps again right after its commit and
            # takes these rows with whatever else came meanwhile, in one larger transaction
            # instead of another slot's tiny one. Each transaction has a fixed cost (a step,
            # AddPartitionsToTxn, the marker, EndTxn); with a slot per notification at 1,000
            # ev/s the relay fell behind its own writers (docs/benchmarks.md). The ring is
            # remembered in case that worker's step had just missed these rows. More
            # workers join once batches grow (_JOIN_FRACTION).
            self._doorbell.remember()
        else:
            self._doorbell.ring()

    async def _notify(self, channel: str, payload: str) -> None:
        assert self._pool is not None
        await self._pool.execute("SELECT pg_notify($1, $2)", channel, payload)

    def _reason(self, error: BaseException) -> str:
        """An error for the log and /readyz, with the settings' secrets taken out."""
        return redact(_describe(error), self.settings)

    def _fault(self, point: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(point)

    # --- Kafka clients ------------------------------------------------------------------------

    async def _ensure_marker_topic(self) -> None:
        """Create the compacted marker topic if it is missing; learn its partition count.
        Retries what Kafka calls retriable (a broker busy or electing) for a while; anything
        else, such as a refused authorization, is a configuration error."""
        s = self.settings
        backoff = Backoff(0.2, 2.0)
        for attempt in range(10):
            try:
                await self._marker_topic()
                return
            except kafka_errors.KafkaError as e:
                if not getattr(e, "retriable", False) or attempt == 9:
                    raise ConfigurationError(
                        f"the exactly-once marker topic {s.eos_marker_topic!r} cannot be "
                        f"described or created ({_describe(e)}): create it (compacted) or grant "
                        "the relay CREATE and DESCRIBE on it"
                    ) from None
                log.warning("exactly-once: the marker topic: %s; retrying", _describe(e))
                await backoff.sleep()

    async def _marker_topic(self) -> None:
        s = self.settings
        admin = AIOKafkaAdminClient(
            bootstrap_servers=s.kafka_bootstrap_servers.split(","),
            **{k: v for k, v in self._kafka.connection_options().items() if k != "client_id"},
        )
        await admin.start()
        try:
            if s.eos_marker_topic not in await admin.list_topics():
                brokers = len((await admin.describe_cluster())["brokers"])
                topic = NewTopic(
                    s.eos_marker_topic,
                    num_partitions=1,
                    replication_factor=min(3, brokers),
                    topic_configs={
                        "cleanup.policy": "compact",
                        "segment.ms": "600000",
                        "min.insync.replicas": str(min(2, brokers)),
                    },
                )
                # aiokafka returns the brokers' per-topic errors rather than raising them.
                response = await admin.create_topics([topic])
                code = response.topic_errors[0][1]
                if code == 0:
                    log.info("created the exactly-once marker topic %s", s.eos_marker_topic)
                elif code != kafka_errors.TopicAlreadyExistsError.errno:  # another relay's
                    raise kafka_errors.for_code(code)()
            described = (await admin.describe_topics([s.eos_marker_topic]))[0]
            if described["error_code"]:
                raise kafka_errors.for_code(described["error_code"])()
            self._marker_partitions = max(1, len(described["partitions"]))
        finally:
            await admin.close()

    async def _producer_for(self, slot: int) -> AIOKafkaProducer:
        """A started transactional producer of ``slot``: starting it fences any earlier
        producer of the slot and ends that one's open transaction (committed or aborted by
        the coordinator, whichever it was doing). Retries while Kafka is unreachable."""
        s = self.settings
        backoff = Backoff(s.reconnect_min_delay, s.reconnect_max_delay)
        while True:
            producer = AIOKafkaProducer(
                bootstrap_servers=s.kafka_bootstrap_servers.split(","),
                transactional_id=self._transactional_id(slot),
                transaction_timeout_ms=round(s.eos_transaction_timeout * 1000),
                enable_idempotence=True,
                acks="all",
                linger_ms=s.kafka_linger_ms,
                max_batch_size=min(s.kafka_batch_size, s.kafka_max_request_size),
                max_request_size=s.kafka_max_request_size,
                compression_type=s.kafka_compression_type,
                **self._kafka.connection_options(),
            )
            try:
                await asyncio.wait_for(producer.start(), s.kafka_send_timeout)
                self.counters["fences"] += 1
                self.events.emit("eos_fence")
                log.info(
                    "exactly-once slot %d: producer %s started; any earlier producer of the "
                    "slot is fenced and its open transaction ended",
                    slot,
                    self._transactional_id(slot),
                )
                return producer
            except (kafka_errors.KafkaError, OSError, TimeoutError) as e:
                await _stop_quietly(producer)
                reason = self._reason(e)
                if not self.kafka_outage.failed(reason):
                    log.info(
                        "exactly-once slot %d: transactional producer not started (%s); retrying",
                        slot,
                        reason,
                    )
                await backoff.sleep()

    def _marker_reader(self, isolation_level: str) -> AIOKafkaConsumer:
        """A consumer of no group for reading the marker partition."""
        return AIOKafkaConsumer(
            bootstrap_servers=self.settings.kafka_bootstrap_servers.split(","),
            isolation_level=isolation_level,
            enable_auto_commit=False,
            group_id=None,
            **self._kafka.connection_options(),
        )

    async def _committed_seq(self, slot: int) -> int:
        """The highest sequence of ``slot`` whose marker committed (0: none), read
        read_committed from the start of the marker partition up to its high watermark as it
        was once this slot's producer had started. Call it only after that (the producer
        before it fenced, its transaction ended)."""
        s = self.settings
        tp = TopicPartition(s.eos_marker_topic, slot % self._marker_partitions)
        # Not up to the last stable offset (what a read_committed consumer's end_offsets
        # gives): it stops at the first offset of the oldest open transaction, and another
        # slot's open transaction can hold it below this slot's committed marker; the batch
        # would be judged not committed and sent twice (seen: a relay frozen with its
        # transaction open while another relay recovered a slot). The high watermark is past
        # this slot's marker, if any; the read_committed consumer below gets there once every
        # transaction begun before it has ended (the broker aborts one left open at its
        # timeout, and a slot taken over is fenced).
        probe = self._marker_reader("read_uncommitted")
        await probe.start()
        try:
            end = (await probe.end_offsets([tp]))[tp]
        finally:
            await probe.stop()
        consumer = self._marker_reader("read_committed")
        await consumer.start()
        try:
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            key = marker_key(self._transactional_id(slot))
            best = 0
            deadline = asyncio.get_running_loop().time() + 60.0
            while await consumer.position(tp) < end:
                if asyncio.get_running_loop().time() > deadline:
                    # Settling nothing is safe: the batch stays stamped, its keys wait, and
                    # the slot's next owner (or this worker, re-leasing it) asks again.
                    raise TimeoutError(
                        f"the marker partition {tp} was not read up to offset {end} within "
                        "60 s (a transaction begun before it still open)"
                    )
                batches = await consumer.getmany(tp, timeout_ms=1000)
                for record in batches.get(tp, []):
                    if record.key == key and record.value is not None:
                        best = max(best, int(json.loads(record.value)["seq"]))
            return best
        finally:
            await consumer.stop()

    # --- slots --------------------------------------------------------------------------------

    async def _lease(self, owner: str) -> tuple[int, int | None] | None:
        """A slot for ``owner`` and its outstanding sequence, waiting for one to be free; None
        once the relay stops."""
        pool = self._pool
        assert pool is not None
        s = self.settings
        backoff = Backoff(s.reconnect_min_delay, s.reconnect_max_delay)
        while not self._stop.is_set():
            try:
                for record in await pool.fetch(self._q["eos_free"], s.eos_slots, owner):
                    slot = int(record["slot"])
                    leased = await pool.fetchrow(self._q["eos_lease"], slot, owner, self._lease_ms)
                    if leased is not None:
                        self.counters["leases"] += 1
                        self.events.emit("eos_leased")
                        out = leased["outstanding"]
                        return slot, None if out is None else int(out)
                wait = min(1.0, s.eos_lease / 3)
            except _DATABASE_ERRORS as e:
                self.db_outage.failed(self._reason(e))
                wait = backoff.next_delay()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), wait)
        return None

    async def _step(
        self, slot: int, owner: str, settle: _Settle | None, batch: int
    ) -> list[tuple[OutboxRow, int]]:
        """Settle the slot's batch and stamp the next: its rows, each with the batch's sequence."""
        pool = self._pool
        assert pool is not None
        retry = settle.retry if settle else []
        dead = settle.dead if settle else []
        try:
            records = await pool.fetch(
                self._q["eos_step"],
                slot,
                owner,
                self._lease_ms,
                settle.seq if settle else None,
                settle.committed if settle else None,
                [r[0] for r in retry],
                [r[1] for r in retry],
                [r[2] for r in retry],
                [d[0] for d in dead],
                [d[1] for d in dead],
                self.settings.delete_on_publish,
                batch,
                max(batch * 2, 100),
            )
        except asyncpg.PostgresError as e:
            if getattr(e, "sqlstate", None) == _SLOT_LOST_STATE:
                raise SlotLost(str(e)) from None
            raise
        if self.db_outage.active:
            self.db_outage.recovered()
        return [(OutboxRow(*r[:12]), int(r["seq"])) for r in records]

    async def _worker(self, index: int) -> None:
        owner = f"{self.relay_id}/{index}"
        backoff = Backoff(self.settings.reconnect_min_delay, self.settings.reconnect_max_delay)
        while not self._stop.is_set():
            leased = await self._lease(owner)
            if leased is None:
                return
            slot, outstanding = leased
            try:
                await self._serve(slot, owner, outstanding)
                backoff.reset()
            except SlotLost as e:
                self.counters["slots_lost"] += 1
                self.events.emit("eos_slot_lost")
                log.warning("exactly-once slot %d is no longer this relay's: %s", slot, e)
            except _TRANSIENT as e:
                reason = self._reason(e)
                outage = self.db_outage if isinstance(e, _DATABASE_ERRORS) else self.kafka_outage
                outage.failed(reason)
                log.info(
                    "exactly-once slot %d: %s; its batch in flight is settled when the slot "
                    "is taken again",
                    slot,
                    reason,
                )
                await backoff.sleep()

    async def _serve(self, slot: int, owner: str, outstanding: int | None) -> None:
        lost = self._serving[slot] = asyncio.Event()  # set by the ticker if it was taken
        producer: AIOKafkaProducer | None = None
        settle: _Settle | None = None
        released = False
        try:
            producer = await self._producer_for(slot)
            if outstanding is not None:
                settle = await self._recover(slot, outstanding)
            batch = self.settings.batch_size
            join_at = max(2, round(batch * _JOIN_FRACTION))
            cycling = retiring = False
            try:
                while True:
                    if lost.is_set():
                        raise SlotLost(f"the lease of slot {slot} was taken over")
                    stopping = self._stop.is_set()
                    want = 0 if stopping or retiring else batch
                    stamped = await self._step(slot, owner, settle, want)
                    settle, retiring = None, False
                    if not stamped:
                        if stopping:
                            break
                        if cycling:
                            cycling = False
                            self._cycling -= 1
                        # Woken by a NOTIFY, by the ticker (rows due, a slot settled), by a
                        # worker with a large batch, or to stop.
                        await self._doorbell.wait()
                        continue
                    if not cycling:
                        cycling = True
                        self._cycling += 1
                    if len(stamped) >= join_at:
                        self._doorbell.ring()  # a backlog: another idle worker joins in
                    elif self._cycling > 1:
                        # Small batches and another worker cycling: that one takes what
                        # comes; this one settles its batch and goes idle (counted out now,
                        # so that two such workers do not both leave).
                        retiring, cycling = True, False
                        self._cycling -= 1
                    seq = stamped[0][1]
                    rows = [row for row, _ in stamped]
                    self.events.emit("claimed", len(rows))
                    self._fault("eos_after_stamp")
                    settle, producer = await self._send(producer, slot, owner, seq, rows)
            finally:
                if cycling:
                    self._cycling -= 1
            pool = self._pool
            assert pool is not None
            await pool.execute(self._q["eos_release"], slot, owner)
            released = True
        finally:
            if self._serving.get(slot) is lost:
                del self._serving[slot]
            if producer is not None:
                await _stop_quietly(producer)
            if not released:
                log.debug("exactly-once slot %d left to its lease (%s)", slot, owner)

    async def _recover(self, slot: int, seq: int) -> _Settle:
        """How to settle the batch ``seq`` of ``slot`` that its previous producer may or may
        not have committed (call with this slot's producer started: the old one is fenced)."""
        self._recovering.add(slot)
        try:
            committed = self._trust_markers and await self._committed_seq(slot) >= seq
        finally:
            self._recovering.discard(slot)
        found = "recovered_committed" if committed else "recovered_aborted"
        self.counters["recoveries"] += 1
        self.counters[found] += 1
        self.events.emit(f"eos_{found}")
        log.warning(
            "exactly-once slot %d: batch %d was in flight; its transaction %s",
            slot,
            seq,
            "committed: its rows are marked published"
            if committed
            else "did not commit: its rows are sent again",
        )
        return _Settle(seq, committed)

    async def _send(
        self,
        producer: AIOKafkaProducer,
        slot: int,
        owner: str,
        seq: int,
        rows: Sequence[OutboxRow],
    ) -> tuple[_Settle, AIOKafkaProducer]:
        """Send a stamped batch in one Kafka transaction with its marker; how to settle it."""
        s = self.settings
        if (encoder := self._kafka.encoder) is not None:
            try:
                await encoder.prepare(rows)  # the governed topics' schemas, once each
            except RegistryError as e:
                # The registry does not answer: the batch is given back, no attempt counted.
                self.kafka_outage.failed(str(e), SCHEMA_REGISTRY)
                await asyncio.sleep(0.5)
                return _Settle(seq, False), producer
        messages = []
        rejected: list[tuple[int, str]] = []
        failed: list[tuple[int, str]] = []
        for row in rows:
            try:
                m = to_message(row, header_style=s.header_style)
                key, value = await self._kafka.encode_governed(row, m.key, m.value)
                messages.append((row, KafkaMessage(m.topic, key, value, m.headers)))
            except RowRejected as e:
                rejected.append((row.id, str(e)))
            except NotEncoded as e:
                (rejected if e.permanent else failed).append((row.id, e.reason))
        try:
            missing = await missing_topics(producer, {row.topic for row in rows})
        except (kafka_errors.KafkaError, OSError, TimeoutError) as e:
            self.kafka_outage.failed(self._reason(e))
            await asyncio.sleep(0.5)
            return _Settle(seq, False), producer
        failed += [(row.id, missing[row.topic]) for row in rows if row.topic in missing]
        if rejected or failed:
            # Nothing goes: the rows at fault wait (or are dead-lettered), the rest is stamped
            # again at the next step, behind them in their keys.
            return self._aborted(
                seq, rows, PublishResult(failed=failed, rejected=rejected)
            ), producer
        result = PublishResult()
        try:
            await producer.begin_transaction()
            acks = await self._hand_over(producer, messages, result)
            if not result.failed:
                marker = json.dumps(
                    {"outbox": self._target, "slot": slot, "seq": seq, "ids": [r.id for r in rows]}
                ).encode()
                acks.append(
                    (
                        [],
                        await producer.send(
                            s.eos_marker_topic,
                            value=marker,
                            key=marker_key(self._transactional_id(slot)),
                            partition=slot % self._marker_partitions,
                        ),
                    )
                )
            done = await asyncio.wait_for(
                asyncio.gather(*(a for _, a in acks), return_exceptions=True), s.kafka_send_timeout
            )
            for (sent, _), outcome in zip(acks, done, strict=True):
                if isinstance(outcome, BaseException):
                    if sent and isinstance(outcome, _ROW_ERRORS):
                        result.failed += [(row.id, _describe(outcome)) for row in sent]
                    elif isinstance(outcome, _FENCED):
                        raise outcome
                    else:
                        result.unavailable = _describe(outcome)
            refused = bool(result.failed)
            self._too_large_batches(rows, result)
            if refused or result.unavailable:
                await _end_transaction(producer.abort_transaction(), s.kafka_send_timeout)
                self.counters["aborted"] += 1
                self.events.emit("eos_aborted")
                if result.unavailable and not self.kafka_outage.failed(result.unavailable):
                    log.info(
                        "exactly-once slot %d: batch %d aborted, Kafka unavailable (%s)",
                        slot,
                        seq,
                        result.unavailable,
                    )
                # A new producer (a new epoch) for the next batch: aiokafka keeps the failed
                # batch's sequence numbers after an abort, and the broker would refuse every
                # later batch of that partition as out of order (seen: OutOfOrderSequenceNumber
                # for every batch after a record refused as too large).
                await _stop_quietly(producer)
                producer = await self._refence(slot, owner)
                if result.unavailable:
                    await asyncio.sleep(self._unavailable.next_delay())
                return self._aborted(seq, rows, result), producer
            self._fault("eos_before_commit")
            await _end_transaction(producer.commit_transaction(), s.kafka_send_timeout)
        except _FENCED as e:
            raise SlotLost(f"its producer was fenced ({_describe(e)})") from None
        except (kafka_errors.KafkaError, OSError, TimeoutError) as e:
            # The outcome of the transaction is unknown: fence this producer with a new one,
            # and ask the markers.
            self.kafka_outage.failed(self._reason(e))
            log.warning(
                "exactly-once slot %d: batch %d's transaction failed (%s); settling it from "
                "the markers",
                slot,
                seq,
                _describe(e),
            )
            await _stop_quietly(producer)
            producer = await self._refence(slot, owner)
            return await self._recover(slot, seq), producer
        self._fault("eos_after_commit")
        self._unavailable.reset()
        if self.kafka_outage.active:
            self.kafka_outage.recovered()
        self.counters["committed"] += 1
        self.events.emit("eos_committed")
        self.events.emit("published", len(rows))
        self.events.report_batch(rows, BatchOutcome(published=[r.id for r in rows]), None)
        return _Settle(seq, True), producer

    async def _hand_over(
        self,
        producer: AIOKafkaProducer,
        messages: Sequence[tuple[OutboxRow, KafkaMessage]],
        result: PublishResult,
    ) -> list[tuple[list[OutboxRow], asyncio.Future[Any]]]:
        """Hand the records to ``producer`` in record batches per partition, in row order
        (``send()`` per record, aiokafka's partitioner and accumulator each time, was a
        quarter of a drain's CPU); the rows of each batch with its ack. A record over the
        request size fails its row before anything of it is sent; a topic in ``_alone``
        gets one record per batch, each acknowledged before the next is handed over. At the
        first row that fails, nothing more is handed over (the transaction is aborted)."""
        s = self.settings
        self._partitions.next_publish()
        acks: list[tuple[list[OutboxRow], asyncio.Future[Any]]] = []
        filling: dict[tuple[str, int], tuple[list[OutboxRow], Any]] = {}
        for row, m in messages:
            headers = list(m.headers)
            partition = self._partitions.choose(producer, m.topic, m.key)
            if partition is None:
                result.failed.append((row.id, f"topic {m.topic!r} does not exist in Kafka"))
                return acks
            size = DefaultRecordBatchBuilder.estimate_size_in_bytes(m.key, m.value, headers)
            if size > s.kafka_max_request_size:
                result.failed.append(
                    (
                        row.id,
                        f"MessageSizeTooLargeError: the record is about {size} bytes, over "
                        f"NOTIFY_OUTBOX_KAFKA_MAX_REQUEST_SIZE ({s.kafka_max_request_size})",
                    )
                )
                return acks
            tp = (m.topic, partition)
            entry = filling.get(tp)
            if (
                entry is not None
                and entry[1].append(timestamp=None, key=m.key, value=m.value, headers=headers)
                is not None
            ):
                entry[0].append(row)
                continue
            if entry is not None:  # full: it goes, a new one starts with this record
                acks.append(
                    (entry[0], await producer.send_batch(entry[1], m.topic, partition=partition))
                )
            builder = producer.create_batch()
            builder.append(timestamp=None, key=m.key, value=m.value, headers=headers)
            if m.topic not in self._alone:
                filling[tp] = ([row], builder)
                continue
            filling.pop(tp, None)
            ack = await producer.send_batch(builder, m.topic, partition=partition)
            acks.append(([row], ack))
            try:
                await asyncio.wait_for(asyncio.shield(ack), s.kafka_send_timeout)
            except _ROW_ERRORS:
                return acks  # classified with the other acks
        for (topic, partition), (batch_rows, builder) in filling.items():
            acks.append(
                (batch_rows, await producer.send_batch(builder, topic, partition=partition))
            )
        return acks

    def _too_large_batches(self, rows: Sequence[OutboxRow], result: PublishResult) -> None:
        """A broker refuses a whole record batch over the topic's ``max.message.bytes``,
        however small its records: where such a refusal hit several rows of a topic, which one
        is too large is unknown. Those rows are given back with no attempt counted, and the
        topic's records go one per batch from now on (each waits for its ack before the next
        is sent), so that a refusal names its row."""
        too_large = {
            row.topic
            for row in rows
            for row_id, reason in result.failed
            if row.id == row_id and reason.startswith(_TOO_LARGE_NAMES)
        }
        unsure = {t for t in too_large - self._alone if sum(r.topic == t for r in rows) > 1}
        if not unsure:
            return
        self._alone |= unsure
        topic_of = {row.id: row.topic for row in rows}
        result.failed = [f for f in result.failed if topic_of[f[0]] not in unsure]
        log.warning(
            "exactly-once: a record batch of %s was over the topic's max.message.bytes; its "
            "rows go again, one record per batch",
            ", ".join(sorted(unsure)),
        )

    async def _refence(self, slot: int, owner: str) -> AIOKafkaProducer:
        """A new producer of ``slot`` for this worker, which fences its previous one; only
        while the slot is still this worker's: a relay frozen past its lease must not fence
        the producer of the relay that took the slot over."""
        pool = self._pool
        assert pool is not None
        if await pool.fetchval(self._q["eos_renew"], slot, owner, self._lease_ms) is None:
            raise SlotLost(f"the lease of slot {slot} was taken over")
        return await self._producer_for(slot)

    def _aborted(self, seq: int, rows: Sequence[OutboxRow], result: PublishResult) -> _Settle:
        outcome = decide(rows, result, self.settings, jitter=_jitter)
        if outcome.retry:
            self.events.emit("retried", len(outcome.retry))
        if outcome.dead:
            self.events.emit("dead_lettered", len(outcome.dead))
        for row_id, reason, delay in outcome.retry:
            log.warning("row %d failed (%s); retrying in %.1fs", row_id, reason, delay)
        for row_id, reason in outcome.dead:
            log.error("row %d dead-lettered: %s", row_id, reason)
        self.events.report_batch(rows, outcome, result.unavailable)
        return _Settle(seq, False, outcome.retry, outcome.dead)

    async def _housekeeping(self) -> None:
        """Retention, as the at-least-once relay does it: published rows kept for
        ``keep_published``, dead letters for ``dead_letter_retention``."""
        s = self.settings
        pool = self._pool
        assert pool is not None
        if s.delete_on_publish and s.dead_letter_retention is None:
            return
        while True:
            await asyncio.sleep(s.cleanup_interval)
            try:
                while not s.delete_on_publish:
                    status = await pool.execute(
                        self._q["delete_expired"], s.keep_published, s.cleanup_batch
                    )
                    n = int(status.split()[-1])
                    if n:
                        self.events.emit("cleanup", n)
                    if n < s.cleanup_batch:
                        break
                if (retention := s.dead_letter_retention) is not None:
                    where = DeadLetterFilter(older_than=timedelta(seconds=retention))
                    n = await purge(pool, self._q.names, where, batch=s.cleanup_batch)
                    report_expired(n, retention, self.events)
            except _DATABASE_ERRORS as e:
                log.warning("retention cleanup failed: %s", _describe(e))

    async def _ticker(self) -> None:
        """The relay's one periodic statement (``eos_tick``), every ``poll_interval`` or a
        third of the lease, whichever is shorter: it renews the leases of every slot this
        relay's workers hold (a worker whose slot was taken over is told), wakes the workers
        when rows are due (the fallback poll), and settles the batches of slots whose holder
        vanished (its lease expired with a batch in flight), whose rows hold back their keys
        until then, even when every worker of this relay is busy with a slot of its own."""
        pool = self._pool
        assert pool is not None
        s = self.settings
        every = min(s.poll_interval, s.eos_lease / 3)
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), every)
            if self._stop.is_set():
                return
            try:
                watched = dict(self._serving)  # slots served before the statement
                tick = await pool.fetchrow(
                    self._q["eos_tick"], f"{self.relay_id}/", self._lease_ms, list(watched)
                )
                assert tick is not None
                if self.db_outage.active:
                    self.db_outage.recovered()
                held = set(tick["held"])
                for slot, lost in watched.items():
                    if slot not in held:
                        lost.set()
                        self._doorbell.ring_all()  # its worker may be idle: let it go
                if tick["due"]:
                    self.events.emit("wake:poll")
                    self._doorbell.ring_all()
                orphans = list(tick["orphans"])
                if orphans and (self._rescuing is None or self._rescuing.done()):
                    # Apart from the ticks: a rescue may wait for Kafka, the leases may not.
                    self._rescuing = asyncio.create_task(self._rescue(orphans))
            except _DATABASE_ERRORS as e:
                self.db_outage.failed(self._reason(e))
            self.db_outage.remind()
            self.kafka_outage.remind()

    async def _rescue(self, orphans: list[int]) -> None:
        """Settle the batch in flight of each abandoned slot, then let the slot go."""
        pool = self._pool
        assert pool is not None
        owner = f"{self.relay_id}/rescue"
        for slot in orphans:
            try:
                leased = await pool.fetchrow(self._q["eos_lease"], slot, owner, self._lease_ms)
                if leased is None:
                    continue  # another relay was first
                if leased["outstanding"] is not None:
                    producer = await self._producer_for(slot)
                    try:
                        settle = await self._recover(slot, int(leased["outstanding"]))
                        await self._step(slot, owner, settle, 0)
                        # Rows given back, and their keys' later rows, are due at once.
                        self._doorbell.ring_all()
                    finally:
                        await _stop_quietly(producer)
                await pool.execute(self._q["eos_release"], slot, owner)
            except SlotLost:
                continue
            except _TRANSIENT as e:
                log.warning(
                    "exactly-once: settling abandoned slot %d failed (%s)", slot, _describe(e)
                )


async def _end_transaction(call: Awaitable[Any], within: float) -> None:
    """aiokafka's commit or abort, within ``within`` seconds. When its sender routine crashed
    on a lost connection, aiokafka's transaction manager is left in FATAL_ERROR and the call
    fails an ``assert`` of its state machine (seen in the fault suite: "Invalid state transition
    TransactionState.FATAL_ERROR -> TransactionState.ABORTING_TRANSACTION" during a broker
    restart, which ended the relay). That is a transaction whose outcome is unknown, like any
    other failure of it: raised as a KafkaError, so the caller fences the producer and settles
    the batch from the markers."""
    try:
        await asyncio.wait_for(call, within)
    except AssertionError as e:
        raise kafka_errors.KafkaError(f"the producer's transaction state is broken: {e}") from e


async def _stop_quietly(producer: AIOKafkaProducer) -> None:
    """Stop a producer that may be broken (fenced, its broker gone) without waiting long."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(producer.stop(), 5.0)
