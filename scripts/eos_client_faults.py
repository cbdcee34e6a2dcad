"""Which Kafka client should the exactly-once mode use? Transactional producers under faults
(issue #35, item 3; docs/concepts/exactly-once-client.md).

On a local three-node KRaft cluster (``devstack.kafka_cluster``: RF 3, ``min.insync.replicas``
2) it runs each client's transactional producer, aiokafka's ``AIOKafkaProducer`` and
confluent-kafka's synchronous ``Producer`` (librdkafka; its blocking calls in
``asyncio.to_thread``), through the same faults, ``--rounds`` rounds, the clients alternating
(ABBA...). Every transaction writes ``RECORDS`` records with headers over the partitions of an
RF-3 topic. The faults:

- ``rejected``: one record of the transaction is rejected by the broker (4 KB to a topic whose
  ``max.message.bytes`` is 1 KB, ``MESSAGE_TOO_LARGE``) besides the 10 good ones; then commit:
  the case librdkafka documents as ``txn_requires_abort()``;
- ``coord-kill``: SIGKILL the transaction coordinator's node between produce and commit;
  commit, then the next transaction; the node is restarted afterwards;
- ``fenced``: a second producer with the same transactional.id starts while the first has an
  open transaction; what the old one sees on its next send and commit; the new one goes on;
- ``all-down``: every node SIGKILLed between produce and commit, restarted after ``--down``
  seconds (back within ``transaction.timeout.ms``): how long commit blocks, how it ends,
  when the next transaction commits;
- ``all-down-long``: the same, down ``--down-long`` seconds, past the transaction timeout: does
  a commit call give up on its own while no broker answers?
- ``all-down-t10`` (confluent-kafka only: aiokafka has no such argument): as ``all-down-long``
  but ``commit_transaction(10)``, an explicit per-call timeout, instead of ``-1`` (the
  transaction's remaining time, which librdkafka recommends);
- ``txn-timeout``: produce, then wait past ``transaction.timeout.ms`` (the broker aborts the
  transaction and bumps the producer epoch) before committing (KIP-360's case).

What the script does on an error follows each client's documentation: librdkafka's error
classes (``retriable()``: call commit again; ``txn_requires_abort()``: abort and go on;
``fatal()``: a new producer); aiokafka has none, so: ``ProducerFenced`` or a call that does not
return within the bound (``--bound``): a new producer; any other error: abort (a new producer
if that fails). Finally a read_committed consumer reads the whole topic and counts records
missing from transactions whose commit returned, visible records of transactions that were
aborted or fenced, partly visible transactions and duplicates.

Usage::

    PYTHONPATH=. .venv/bin/python scripts/eos_client_faults.py --rounds 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import confluent_kafka
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka import __version__ as aiokafka_version
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import ProducerFenced

from devstack.kafka_cluster import KafkaCluster

PARTITIONS = 3
RECORDS = 10
TXN_TIMEOUT_MS = 30_000
CLIENTS = ("aiokafka", "confluent")
FAULTS = (
    "rejected",
    "coord-kill",
    "fenced",
    "all-down",
    "all-down-long",
    "all-down-t10",
    "txn-timeout",
)
# librdkafka only: commit_transaction(10) instead of (-1), as the per-call timeout it has.
RD_ONLY = frozenset({"all-down-t10"})

log = logging.getLogger("eos-faults")


class Hung(Exception):
    """A client call did not return within the bound."""


async def bounded(aw: Awaitable[Any], seconds: float) -> Any:
    try:
        return await asyncio.wait_for(aw, seconds)
    except TimeoutError:
        raise Hung(f"no answer within {seconds:.0f}s") from None


def describe(exc: BaseException) -> str:
    """Exception type, and for librdkafka the error name and its class flags."""
    if isinstance(exc, confluent_kafka.KafkaException) and exc.args:
        err = exc.args[0]
        if isinstance(err, confluent_kafka.KafkaError):
            flags = [
                name
                for name, on in (
                    ("retriable", err.retriable()),
                    ("abortable", err.txn_requires_abort()),
                    ("fatal", err.fatal()),
                )
                if on
            ]
            return f"KafkaException({err.name()}{', ' + '+'.join(flags) if flags else ''})"
    return type(exc).__name__


# -- the two clients behind one interface ---------------------------------------------------


class Client:
    name: str

    def __init__(self, bootstrap: str, topic: str, txn_id: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.txn_id = txn_id

    async def start(self) -> None:
        raise NotImplementedError

    async def begin(self) -> None:
        raise NotImplementedError

    async def produce(self, label: str, count: int) -> None:
        """Send ``count`` records of transaction ``label`` and wait for their delivery."""
        raise NotImplementedError

    async def produce_big(self, topic: str, label: str) -> None:
        """Send one 4 KB record to ``topic`` and wait for its delivery."""
        raise NotImplementedError

    async def commit(self) -> None:
        raise NotImplementedError

    async def abort(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def action(self, exc: BaseException) -> str:
        """What the relay would do after this error: retry, abort or recreate."""
        raise NotImplementedError

    def _record(self, label: str, i: int) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
        value = f"{label}:{i}".encode()
        headers = [("txn", label.encode()), ("client", self.name.encode()), ("seq", b"%d" % i)]
        return value, f"k{i}".encode(), headers


class AioClient(Client):
    name = "aiokafka"
    _producer: AIOKafkaProducer | None = None

    async def start(self) -> None:
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            transactional_id=self.txn_id,
            enable_idempotence=True,
            acks="all",
            transaction_timeout_ms=TXN_TIMEOUT_MS,
            request_timeout_ms=10_000,
            linger_ms=5,
        )
        await self._producer.start()

    @property
    def producer(self) -> AIOKafkaProducer:
        assert self._producer is not None
        return self._producer

    async def begin(self) -> None:
        await self.producer.begin_transaction()

    async def produce(self, label: str, count: int) -> None:
        futures = []
        for i in range(count):
            value, key, headers = self._record(label, i)
            futures.append(
                await self.producer.send(
                    self.topic, value, key=key, headers=headers, partition=i % PARTITIONS
                )
            )
        await asyncio.gather(*futures)

    async def produce_big(self, topic: str, label: str) -> None:
        value, key, headers = self._record(label, 0)
        future = await self.producer.send(topic, value + b"x" * 4096, key=key, headers=headers)
        await future

    async def commit(self) -> None:
        await self.producer.commit_transaction()

    async def abort(self) -> None:
        await self.producer.abort_transaction()

    async def close(self) -> None:
        if self._producer is not None:
            await self._producer.stop()

    def action(self, exc: BaseException) -> str:
        if isinstance(exc, ProducerFenced | Hung):
            return "recreate"
        return "abort"


class RdClient(Client):
    name = "confluent"
    _producer: confluent_kafka.Producer | None = None
    # -1: the transaction's remaining time, as librdkafka recommends.
    commit_timeout: float = -1

    async def start(self) -> None:
        self._producer = confluent_kafka.Producer(
            {
                "bootstrap.servers": self.bootstrap,
                "transactional.id": self.txn_id,
                "enable.idempotence": True,
                "acks": "all",
                "transaction.timeout.ms": TXN_TIMEOUT_MS,
                "linger.ms": 5,
                "logger": logging.getLogger("rdkafka"),
            }
        )
        await asyncio.to_thread(self._producer.init_transactions, 30)

    @property
    def producer(self) -> confluent_kafka.Producer:
        assert self._producer is not None
        return self._producer

    async def begin(self) -> None:
        self.producer.begin_transaction()

    async def produce(self, label: str, count: int) -> None:
        errors: list[confluent_kafka.KafkaError] = []

        def delivered(err: confluent_kafka.KafkaError | None, _msg: Any) -> None:
            if err is not None:
                errors.append(err)

        def send_all() -> None:
            for i in range(count):
                value, key, headers = self._record(label, i)
                self.producer.produce(
                    self.topic,
                    value,
                    key,
                    partition=i % PARTITIONS,
                    headers=headers,
                    on_delivery=delivered,
                )
            left = self.producer.flush(30)
            if left:
                raise Hung(f"{left} records undelivered after 30s")
            if errors:
                raise confluent_kafka.KafkaException(errors[0])

        await asyncio.to_thread(send_all)

    async def produce_big(self, topic: str, label: str) -> None:
        errors: list[confluent_kafka.KafkaError] = []

        def delivered(err: confluent_kafka.KafkaError | None, _msg: Any) -> None:
            if err is not None:
                errors.append(err)

        def send() -> None:
            value, key, headers = self._record(label, 0)
            self.producer.produce(
                topic, value + b"x" * 4096, key, headers=headers, on_delivery=delivered
            )
            if self.producer.flush(30):
                raise Hung("the record was not delivered within 30s")
            if errors:
                raise confluent_kafka.KafkaException(errors[0])

        await asyncio.to_thread(send)

    async def commit(self) -> None:
        await asyncio.to_thread(self.producer.commit_transaction, self.commit_timeout)

    async def abort(self) -> None:
        await asyncio.to_thread(self.producer.abort_transaction, -1)

    async def close(self) -> None:
        if self._producer is not None:
            producer = self._producer
            self._producer = None
            await asyncio.to_thread(producer.purge)
            await asyncio.to_thread(producer.close, 5)

    def action(self, exc: BaseException) -> str:
        if isinstance(exc, confluent_kafka.KafkaException) and exc.args:
            err = exc.args[0]
            if isinstance(err, confluent_kafka.KafkaError):
                if err.fatal():
                    return "recreate"
                if err.txn_requires_abort():
                    return "abort"
                if err.retriable():
                    return "retry"
        if isinstance(exc, Hung):
            return "recreate"
        return "abort"


MAKERS: dict[str, type[Client]] = {"aiokafka": AioClient, "confluent": RdClient}


# -- one transaction, with the error policy -------------------------------------------------


@dataclass
class Outcome:
    """How one transaction ended, as the client saw it."""

    label: str
    result: str = "unknown"  # committed | aborted | unknown (commit state not known)
    errors: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    first_error_s: float | None = None  # from the start of commit to the first error
    end_s: float | None = None  # from the start of commit to the end (result known)
    hung: bool = False


class Slot:
    """A transactional id and its current producer, recreated when the policy says so."""

    def __init__(self, kind: str, bootstrap: str, topic: str, txn_id: str, bound: float) -> None:
        self.kind = kind
        self.bootstrap = bootstrap
        self.topic = topic
        self.txn_id = txn_id
        self.bound = bound
        self.commit_timeout: float = -1  # for librdkafka's commit_transaction
        self.client: Client = self.make()
        self.recreated = 0
        self.ledger: dict[str, str] = {}  # label -> the client's view of its result

    def make(self) -> Client:
        client = MAKERS[self.kind](self.bootstrap, self.topic, self.txn_id)
        if isinstance(client, RdClient):
            client.commit_timeout = self.commit_timeout
        return client

    async def start(self) -> float:
        started = time.monotonic()
        await bounded(self.client.start(), self.bound)
        return time.monotonic() - started

    async def recreate(self) -> None:
        old = self.client
        with contextlib.suppress(Exception):
            await asyncio.wait_for(old.close(), 10)
        self.client = self.make()
        self.recreated += 1
        await bounded(self.client.start(), self.bound)

    async def open(self, label: str) -> None:
        """Begin a transaction and write its records (delivered, so it is open at the
        coordinator and on the partitions)."""
        self.ledger[label] = "unknown"
        await bounded(self.client.begin(), self.bound)
        await bounded(self.client.produce(label, RECORDS), self.bound)

    async def finish(self, label: str, deadline_s: float) -> Outcome:
        """Commit, following the client's error policy until the result is known or
        ``deadline_s`` has passed."""
        out = Outcome(label)
        started = time.monotonic()
        attempt: Callable[[], Awaitable[None]] = self.client.commit
        committing = True
        while True:
            left = deadline_s - (time.monotonic() - started)
            if left <= 0:
                out.hung = True
                break
            try:
                await bounded(attempt(), min(left, self.bound))
            except Exception as exc:
                if out.first_error_s is None:
                    out.first_error_s = time.monotonic() - started
                out.errors.append(describe(exc))
                if isinstance(exc, Hung):
                    out.hung = True
                action = self.client.action(exc)
                if not committing and action != "retry":
                    action = "recreate"  # the abort itself failed
                out.actions.append(action)
                if action == "retry":
                    await asyncio.sleep(0.5)
                    continue
                if action == "abort":
                    attempt, committing = self.client.abort, False
                    continue
                try:
                    await self.recreate()
                except Exception as again:
                    out.errors.append(f"recreate: {describe(again)}")
                break
            else:
                out.result = "committed" if committing else "aborted"
                break
        out.end_s = time.monotonic() - started
        self.ledger[label] = out.result
        return out

    async def transaction(self, label: str, deadline_s: float) -> Outcome:
        """A whole transaction; an error before commit counts as the commit's."""
        try:
            await self.open(label)
        except Exception as exc:
            out = Outcome(label, errors=[f"open: {describe(exc)}"])
            action = self.client.action(exc)
            out.actions.append(action)
            if action == "recreate":
                with contextlib.suppress(Exception):
                    await self.recreate()
            else:
                with contextlib.suppress(Exception):
                    await bounded(self.client.abort(), self.bound)
                    out.result = "aborted"
            self.ledger[label] = out.result
            return out
        return await self.finish(label, deadline_s)

    async def until_committed(self, prefix: str, deadline_s: float) -> tuple[float | None, int]:
        """Transactions until one commits: (seconds taken or None, attempts)."""
        started = time.monotonic()
        attempts = 0
        while time.monotonic() - started < deadline_s:
            attempts += 1
            out = await self.transaction(f"{prefix}-{attempts}", self.bound)
            if out.result == "committed":
                return time.monotonic() - started, attempts
            await asyncio.sleep(0.5)
        return None, attempts


# -- the faults -----------------------------------------------------------------------------


@dataclass
class FaultResult:
    client: str
    round: int
    fault: str
    commit: str = ""  # how the faulted transaction's commit ended
    commit_s: float | None = None
    first_error_s: float | None = None
    errors: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    next_commit_s: float | None = None  # fault injected -> next transaction committed
    recreated: int = 0
    notes: list[str] = field(default_factory=list)


def _tag(out: Outcome) -> str:
    return "hung" if out.hung and out.result == "unknown" else out.result


async def ensure_all_up(cluster: KafkaCluster) -> None:
    down = [i for i in range(len(cluster.nodes)) if i not in cluster.running()]
    for i in down:
        await asyncio.to_thread(cluster.start, i)


async def fault_rejected(cluster: KafkaCluster, slot: Slot, res: FaultResult) -> None:
    label = f"{slot.txn_id}-rej"
    await slot.open(label)
    before = slot.recreated
    injected = time.monotonic()
    try:
        await bounded(slot.client.produce_big(f"{slot.topic}-small", f"{label}-big"), slot.bound)
        res.notes.append("big record: accepted")
    except Exception as exc:
        res.notes.append(f"big record: {describe(exc)}")
    out = await slot.finish(label, slot.bound)
    res.commit, res.commit_s, res.first_error_s = _tag(out), out.end_s, out.first_error_s
    res.errors, res.actions = out.errors, out.actions
    took, attempts = await slot.until_committed(f"{label}-next", 60)
    res.next_commit_s = None if took is None else time.monotonic() - injected
    res.notes.append(f"next: {attempts} attempt(s)")
    res.recreated = slot.recreated - before


async def fault_coord_kill(cluster: KafkaCluster, slot: Slot, res: FaultResult) -> None:
    label = f"{slot.txn_id}-ck"
    await slot.open(label)
    victim = await asyncio.to_thread(cluster.find_coordinator, slot.txn_id)
    res.notes.append(f"coordinator node {victim + 1}")
    before = slot.recreated
    injected = time.monotonic()
    await asyncio.to_thread(cluster.kill, victim)
    out = await slot.finish(label, slot.bound)
    res.commit, res.commit_s, res.first_error_s = _tag(out), out.end_s, out.first_error_s
    res.errors, res.actions = out.errors, out.actions
    took, attempts = await slot.until_committed(f"{label}-next", 90)
    res.next_commit_s = None if took is None else time.monotonic() - injected
    res.notes.append(f"next: {attempts} attempt(s)")
    restart = time.monotonic()
    await asyncio.to_thread(cluster.start, victim)
    res.notes.append(f"node back in {time.monotonic() - restart:.1f}s")
    after = await slot.transaction(f"{label}-after", slot.bound)
    if after.result != "committed":
        res.notes.append(f"txn after restart: {_tag(after)} {after.errors}")
    res.recreated = slot.recreated - before


async def fault_fenced(cluster: KafkaCluster, slot: Slot, res: FaultResult) -> None:
    label = f"{slot.txn_id}-fenced"
    await slot.open(label)
    old = slot.client
    new = slot.make()
    started = time.monotonic()
    try:
        await bounded(new.start(), slot.bound)
        res.notes.append(f"new init {time.monotonic() - started:.2f}s")
    except Exception as exc:
        res.notes.append(f"new init failed: {describe(exc)}")
    # The old producer carries on: one more record, then commit.
    for step, call in (
        ("send", lambda: old.produce(f"{label}-late", 1)),
        ("commit", old.commit),
    ):
        t0 = time.monotonic()
        try:
            await bounded(call(), 30)
            res.errors.append(f"{step}: ok")
        except Exception as exc:
            res.errors.append(f"{step}: {describe(exc)} ({time.monotonic() - t0:.1f}s)")
    slot.ledger[label] = "fenced"
    slot.ledger[f"{label}-late"] = "fenced"
    res.commit = "fenced" if not any(e == "commit: ok" for e in res.errors) else "COMMITTED"
    with contextlib.suppress(Exception):
        await asyncio.wait_for(old.close(), 10)
    slot.client = new
    took, attempts = await slot.until_committed(f"{label}-next", 60)
    res.next_commit_s = took
    res.notes.append(f"new producer: {attempts} attempt(s)")


async def fault_all_down(cluster: KafkaCluster, slot: Slot, res: FaultResult, down: float) -> None:
    label = f"{slot.txn_id}-{res.fault}"
    await slot.open(label)
    before = slot.recreated
    injected = time.monotonic()
    for i in range(len(cluster.nodes)):
        await asyncio.to_thread(cluster.kill, i)

    async def restart_later() -> float:
        await asyncio.sleep(down)
        await asyncio.to_thread(cluster.start_all)
        return time.monotonic() - injected

    restarter = asyncio.create_task(restart_later())
    out = await slot.finish(label, slot.bound)
    back = await restarter
    res.notes.append(f"cluster back {back:.1f}s after the kill")
    res.commit, res.commit_s, res.first_error_s = _tag(out), out.end_s, out.first_error_s
    res.errors, res.actions = out.errors, out.actions
    took, attempts = await slot.until_committed(f"{label}-next", 90)
    res.next_commit_s = None if took is None else time.monotonic() - injected
    res.notes.append(f"next: {attempts} attempt(s)")
    res.recreated = slot.recreated - before


async def fault_txn_timeout(cluster: KafkaCluster, slot: Slot, res: FaultResult) -> None:
    label = f"{slot.txn_id}-to"
    await slot.open(label)
    before = slot.recreated
    # Past transaction.timeout.ms, plus the broker's 2 s scan for timed-out transactions.
    await asyncio.sleep(TXN_TIMEOUT_MS / 1000 + 4)
    injected = time.monotonic()
    out = await slot.finish(label, slot.bound)
    res.commit, res.commit_s, res.first_error_s = _tag(out), out.end_s, out.first_error_s
    res.errors, res.actions = out.errors, out.actions
    took, attempts = await slot.until_committed(f"{label}-next", 60)
    res.next_commit_s = None if took is None else time.monotonic() - injected
    res.notes.append(f"next: {attempts} attempt(s)")
    res.recreated = slot.recreated - before


# -- verification ---------------------------------------------------------------------------


async def read_topic(bootstrap: str, topic: str, isolation: str) -> tuple[list[bytes], bool]:
    """Every record visible at this isolation level; and whether the end was reached."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        isolation_level=isolation,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        # The high watermarks (a read_uncommitted client's end offsets), not read_committed's
        # last stable offsets: those can stand below a transaction whose commit the producer
        # was already told of (the coordinator writes its markers after answering; seen right
        # after 16 of 200 commits on one broker), and the records behind would look missing. A
        # read_committed consumer passes the high watermark once every transaction below it
        # ended.
        probe = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_uncommitted")
        await probe.start()
        try:
            ends = await probe.end_offsets(tps)
        finally:
            await probe.stop()
        values: list[bytes] = []
        deadline = time.monotonic() + 60
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            if time.monotonic() > deadline:
                return values, False
            batches = await consumer.getmany(timeout_ms=1000)
            for records in batches.values():
                values.extend(r.value for r in records)
        return values, True
    finally:
        await consumer.stop()


def check(ledgers: dict[str, dict[str, str]], values: list[bytes]) -> dict[str, dict[str, int]]:
    """Per client: committed-but-missing, aborted-but-visible, partial, duplicate records."""
    seen = Counter(values)
    by_label: dict[str, int] = defaultdict(int)
    for value in seen:
        by_label[value.decode().rsplit(":", 1)[0]] += 1
    report: dict[str, dict[str, int]] = {}
    for client, ledger in ledgers.items():
        counts = Counter(
            {
                "transactions": 0,
                "committed": 0,
                "missing": 0,
                "aborted_visible": 0,
                "fenced_visible": 0,
                "partial": 0,
                "unknown_visible": 0,
                "unknown_invisible": 0,
                "duplicates": 0,
            }
        )
        for label, result in ledger.items():
            expected = 1 if label.endswith("-late") else RECORDS
            visible = by_label.get(label, 0)
            counts["transactions"] += 1
            if result == "committed":
                counts["committed"] += 1
                counts["missing"] += expected - visible
            elif result == "aborted":
                counts["aborted_visible"] += visible
            elif result == "fenced":
                counts["fenced_visible"] += visible
            elif visible == expected:
                counts["unknown_visible"] += 1
            elif visible == 0:
                counts["unknown_invisible"] += 1
            if 0 < visible < expected:
                counts["partial"] += 1
        prefix = f"eos-{client}-"
        counts["duplicates"] = sum(
            n - 1 for v, n in seen.items() if v.decode().startswith(prefix) and n > 1
        )
        report[client] = dict(counts)
    return report


# -- driver ---------------------------------------------------------------------------------


async def create_topic(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(topic, PARTITIONS, replication_factor=3),
                # For the "rejected" fault: a 4 KB record is too large here.
                NewTopic(
                    f"{topic}-small",
                    1,
                    replication_factor=3,
                    topic_configs={"max.message.bytes": "1024"},
                ),
            ]
        )
    finally:
        await admin.close()


async def one_client(
    cluster: KafkaCluster, kind: str, rnd: int, topic: str, args: argparse.Namespace
) -> tuple[list[FaultResult], dict[str, str], dict[str, Any]]:
    txn_id = f"eos-{kind}-r{rnd}-{uuid.uuid4().hex[:6]}"
    slot = Slot(kind, cluster.bootstrap, topic, txn_id, args.bound)
    extra: dict[str, Any] = {"init_s": await slot.start()}
    commit_ms = []
    for i in range(5):
        out = await slot.transaction(f"{txn_id}-warm{i}", args.bound)
        if out.end_s is not None and out.result == "committed":
            commit_ms.append(out.end_s * 1000)
    extra["commit_ms_median"] = statistics.median(commit_ms) if commit_ms else None
    results = []
    for fault in args.faults:
        if fault in RD_ONLY and kind != "confluent":
            continue
        await ensure_all_up(cluster)
        res = FaultResult(kind, rnd, fault)
        log.info("round %d %s %s", rnd, kind, fault)
        try:
            if fault == "rejected":
                await fault_rejected(cluster, slot, res)
            elif fault == "coord-kill":
                await fault_coord_kill(cluster, slot, res)
            elif fault == "fenced":
                await fault_fenced(cluster, slot, res)
            elif fault == "all-down":
                await fault_all_down(cluster, slot, res, args.down)
            elif fault == "all-down-long":
                await fault_all_down(cluster, slot, res, args.down_long)
            elif fault == "all-down-t10":
                slot.commit_timeout = 10
                if isinstance(slot.client, RdClient):
                    slot.client.commit_timeout = 10
                try:
                    await fault_all_down(cluster, slot, res, args.down_long)
                finally:
                    slot.commit_timeout = -1
                    if isinstance(slot.client, RdClient):
                        slot.client.commit_timeout = -1
            else:
                await fault_txn_timeout(cluster, slot, res)
        except Exception as exc:
            log.exception("fault %s of %s", fault, kind)
            res.notes.append(f"scenario error: {describe(exc)}: {exc}")
            with contextlib.suppress(Exception):
                await slot.recreate()
        print(
            f"  {kind:9} r{rnd} {fault:13} {res.commit or '?':9} commit={res.commit_s} "
            f"first_error={res.first_error_s} {res.errors} {res.actions} "
            f"next={res.next_commit_s} recreated={res.recreated} {res.notes}",
            file=sys.stderr,
            flush=True,
        )
        results.append(res)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(slot.client.close(), 10)
    return results, slot.ledger, extra


def _secs(values: list[float | None]) -> str:
    known = sorted(v for v in values if v is not None)
    missing = len(values) - len(known)
    if not known:
        return "never" if missing else ""
    text = f"{statistics.median(known):.1f}" if len(known) > 1 else f"{known[0]:.1f}"
    if len(known) > 1:
        text += f" ({known[0]:.1f}–{known[-1]:.1f})"
    if missing:
        text += f", never ×{missing}"
    return text


def _tally(items: list[str]) -> str:
    return ", ".join(f"{k} ×{n}" if n > 1 else k for k, n in Counter(items).items()) or "–"


def table(results: list[FaultResult]) -> str:
    rows = [
        "| fault | client | commit | commit call s | first error s | errors seen | "
        "actions | next commit s | recreated |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fault in FAULTS:
        for client in CLIENTS:
            rs = [r for r in results if r.fault == fault and r.client == client]
            if not rs:
                continue
            errors = [e for r in rs for e in dict.fromkeys(r.errors)]
            rows.append(
                f"| {fault} | {client} | {_tally([r.commit for r in rs])} | "
                f"{_secs([r.commit_s for r in rs])} | {_secs([r.first_error_s for r in rs])} | "
                f"{_tally(errors)} | {_tally([a for r in rs for a in r.actions])} | "
                f"{_secs([r.next_commit_s for r in rs])} | "
                f"{sum(r.recreated for r in rs)}/{len(rs)} |"
            )
    return "\n".join(rows)


async def main(args: argparse.Namespace) -> int:
    base = Path(args.dir or tempfile.mkdtemp(prefix="eos-faults-"))
    logging.basicConfig(
        filename=base / "clients.log",
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    started_at = datetime.now(UTC)
    cluster = KafkaCluster(base / "cluster", heap=args.heap)
    t0 = time.monotonic()
    await asyncio.to_thread(cluster.start_all)
    cluster_start_s = time.monotonic() - t0
    print(f"cluster up in {cluster_start_s:.1f}s: {cluster.bootstrap}", file=sys.stderr)
    results: list[FaultResult] = []
    ledgers: dict[str, dict[str, str]] = {c: {} for c in CLIENTS}
    extras: list[dict[str, Any]] = []
    topic = f"eos-faults-{uuid.uuid4().hex[:8]}"
    try:
        await create_topic(cluster.bootstrap, topic)
        for rnd in range(1, args.rounds + 1):
            order = CLIENTS if rnd % 2 else tuple(reversed(CLIENTS))
            for kind in order:
                if kind not in args.clients:
                    continue
                res, ledger, extra = await one_client(cluster, kind, rnd, topic, args)
                results.extend(res)
                ledgers[kind].update(ledger)
                extras.append({"client": kind, "round": rnd, **extra})
        await ensure_all_up(cluster)
        # Open transactions (a fenced or timed-out one) must have been ended by now.
        committed, complete = await read_topic(cluster.bootstrap, topic, "read_committed")
        everything, _ = await read_topic(cluster.bootstrap, topic, "read_uncommitted")
    finally:
        await asyncio.to_thread(cluster.stop_all)
    report = check({c: ledgers[c] for c in args.clients}, committed)
    lines = [
        f"# eos_client_faults: {started_at:%Y-%m-%d %H:%M} UTC, {args.rounds} round(s), "
        f"{platform.node()}, {os.cpu_count()} CPUs",
        "",
        f"aiokafka {aiokafka_version}, confluent-kafka {confluent_kafka.version()} "
        f"(librdkafka {confluent_kafka.libversion()[0]}); 3-node KRaft cluster up in "
        f"{cluster_start_s:.1f}s; transaction.timeout.ms {TXN_TIMEOUT_MS}; bound "
        f"{args.bound:.0f}s; all-down for {args.down:.0f}s, all-down-long for "
        f"{args.down_long:.0f}s",
        "",
        table(results),
        "",
        "| client | init s | commit ms (median, quiet) |",
        "|---|---|---|",
    ]
    for client in args.clients:
        ex = [e for e in extras if e["client"] == client]
        med = [e["commit_ms_median"] for e in ex if e["commit_ms_median"] is not None]
        lines.append(
            f"| {client} | {_secs([e['init_s'] for e in ex])} | "
            f"{statistics.median(med) if med else float('nan'):.0f} |"
        )
    lines += [
        "",
        f"read_committed: {len(committed)} records (read to the end: {complete}); "
        f"read_uncommitted: {len(everything)}",
        "",
        "| client | transactions | committed | missing records | aborted visible | "
        "fenced visible | partly visible txns | unknown: visible / invisible | duplicates |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for client, r in report.items():
        lines.append(
            f"| {client} | {r['transactions']} | {r['committed']} | {r['missing']} | "
            f"{r['aborted_visible']} | {r['fenced_visible']} | {r['partial']} | "
            f"{r['unknown_visible']} / {r['unknown_invisible']} | {r['duplicates']} |"
        )
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(  # noqa: ASYNC240 (once, at the end)
            json.dumps(
                {
                    "started_at": started_at.isoformat(),
                    "cluster_start_s": cluster_start_s,
                    "results": [asdict(r) for r in results],
                    "extras": extras,
                    "report": report,
                    "read_committed_complete": complete,
                },
                indent=2,
            )
        )
    print(f"logs: {base}", file=sys.stderr)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--bound", type=float, default=60.0, help="longest wait for one call")
    parser.add_argument(
        "--down", type=float, default=10.0, help="all-down: seconds down (within the txn timeout)"
    )
    parser.add_argument(
        "--down-long", type=float, default=40.0, help="all-down-long: seconds down (past it)"
    )
    parser.add_argument("--heap", default="512m")
    parser.add_argument("--dir", help="where the cluster and logs go (default: a temp dir)")
    parser.add_argument("--json", help="also write the raw results here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
