"""Prometheus metrics of a relay: counters fed by its events, gauges read from its state, and
table gauges (pending, oldest pending, dead letters) from one bounded query, cached.

The daemon serves them at ``/metrics`` (``notify_outbox/ops/http.py``); an application embedding
the relay adds them to its own registry::

    from prometheus_client import REGISTRY

    async with Relay(settings) as relay, RelayMetrics(relay, registry=REGISTRY) as metrics:
        ...  # refreshes the table gauges every ``stats_interval`` seconds in the background

Every metric carries a ``table`` label (the qualified outbox table). One ``RelayMetrics`` per
registry: a second one on the same registry is refused by ``prometheus_client`` (duplicate
names). It serves the at-least-once ``Relay`` and the ``ExactlyOnceRelay`` alike (anything
that is a ``MonitoredRelay``); the latter adds its transactions, fences, recoveries and slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self

import asyncpg
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from notify_outbox.core.logs import redact
from notify_outbox.core.message import SCHEMA_REGISTRY
from notify_outbox.pg.db import DATABASE_ERRORS, session_parameters, terminate
from notify_outbox.pg.sqlfiles import Queries

if TYPE_CHECKING:
    from notify_outbox.core.events import RelayEvents
    from notify_outbox.core.outbox import BatchOutcome, OutboxRow
    from notify_outbox.core.settings import OutboxSettings
    from notify_outbox.pg.store import LowWaterMark
    from notify_outbox.relay.listener import Listener
    from notify_outbox.relay.outage import Outage

__all__ = ["MonitoredRelay", "OutboxStats", "Readiness", "RelayMetrics", "failure_class"]

log = logging.getLogger("notify_outbox.metrics")

PREFIX = "notify_outbox_"
# Counts of the table gauges stop here: bounded work at any table size.
STATS_LIMIT = 100_000
# Topics beyond this many get the label "_other": a bound on the series a relay exports.
MAX_TOPICS = 100
OTHER_TOPIC = "_other"
# Reason classes of notify_outbox_publish_failures_total: each series exists from the start (at
# 0), so that increase() sees a first failure.
FAILURE_REASONS = (
    "topic_missing", "malformed", "too_large", "not_authorized", "kafka_error",
    "kafka_unavailable", "database", "claim_lost",
)  # fmt: skip
# Wake-up sources the relay emits (RelayEvents' docstring); anything else counts as "other".
WAKE_SOURCES = frozenset({"notification", "poll", "reconnect", "start", "backlog", "retry", "gate"})
# From a few milliseconds (a healthy relay) to the alert thresholds of a stuck one.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
# The event loop is "not responsive" when a heartbeat comes this late (/livez).
LOOP_LAG_LIMIT = 5.0
_HEARTBEAT = 0.5


def failure_class(reason: str) -> str:
    """A row failure's reason (from the publisher) as a small, fixed set of label values."""
    if "does not exist in Kafka" in reason:
        return "topic_missing"
    if reason.startswith("malformed event"):
        return "malformed"
    if "TooLarge" in reason:
        return "too_large"
    if "Authorization" in reason:
        return "not_authorized"
    return "kafka_error"


@dataclass(frozen=True)
class OutboxStats:
    """What the table gauges show; counts saturate at ``STATS_LIMIT``."""

    pending: int
    oldest_pending_seconds: float | None  # None: nothing pending
    dead_lettered: int


@dataclass(frozen=True)
class Readiness:
    """The answer of ``/readyz``: ready, and a check per dependency ("ok" or why not)."""

    ready: bool
    checks: dict[str, str]

    @property
    def reason(self) -> str:
        """The failing checks in one line ("" when ready)."""
        return "; ".join(f"{k}: {v}" for k, v in self.checks.items() if v not in _FINE)

    def as_json(self) -> dict[str, Any]:
        """The body of ``/readyz``."""
        body: dict[str, Any] = {"status": "ready" if self.ready else "not ready"}
        if not self.ready:
            body["reason"] = self.reason
        body["checks"] = self.checks
        return body


_FINE = ("ok", "poll-only")

StatsSource = Callable[[], Awaitable[OutboxStats]]

#: Gauges of a relay's own state (``MonitoredRelay.state_gauges``), by name without the prefix.
STATE_GAUGES = {
    "awake": "1 while the relay holds the gated notify's awake marker (producers skip NOTIFY)",
    "claim_idle_timeout_seconds": "How long the next claim may sit idle before PostgreSQL ends "
    "it (claim_idle_timeout; in auto mode learnt from the relay's stalls)",
    "eos_slots_held": "Exactly-once slots whose lease this relay holds",
    "eos_slots_recovering": "Exactly-once slots whose batch in flight this relay is settling "
    "from the markers (their keys wait meanwhile)",
}


class MonitoredRelay(Protocol):
    """What ``RelayMetrics`` reads of a relay: the at-least-once ``Relay`` and the
    ``ExactlyOnceRelay`` both are one."""

    @property
    def settings(self) -> OutboxSettings: ...
    @property
    def events(self) -> RelayEvents: ...
    @property
    def outcome(self) -> str | None: ...
    @property
    def kafka_outage(self) -> Outage: ...
    @property
    def db_outage(self) -> Outage: ...
    @property
    def listener(self) -> Listener | None: ...
    @property
    def low_water_mark(self) -> LowWaterMark: ...

    def state_gauges(self) -> dict[str, float]:
        """Values of the relay's own gauges, by their name in ``STATE_GAUGES``."""
        ...

    def readiness_checks(self) -> dict[str, str]:
        """Checks of ``/readyz`` that only this kind of relay has: "ok" or why not."""
        ...


class RelayMetrics:
    """Prometheus collectors attached to one relay (see the module docstring).

    ``stats``: how to read the table gauges; by default one dedicated connection to
    ``relay.settings.dsn`` (opened when first needed, reopened after a failure) running the
    ``metrics_stats`` query at most once every ``stats_interval`` seconds, however many
    scrapers ask.
    """

    def __init__(
        self,
        relay: MonitoredRelay,
        registry: CollectorRegistry | None = None,
        *,
        stats_interval: float = 5.0,
        stats: StatsSource | None = None,
        max_topics: int = MAX_TOPICS,
        table: str | None = None,
    ) -> None:
        self.relay = relay
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        names = relay.settings.names
        #: The ``table`` label (default the relay's ``schema.table``; a fleet's may differ).
        self.table = table or f"{names.schema}.{names.table}"
        self.stats_interval = stats_interval
        self._stats_source = stats or self._query_stats
        self._max_topics = max_topics
        self._topics: set[str] = set()
        self.stats: OutboxStats | None = None
        self._stats_at: float | None = None  # monotonic time of the last successful read
        self._stats_ok_at: float | None = None
        self._refreshing: asyncio.Task[None] | None = None
        self._conn: asyncpg.Connection | None = None
        self._queries = Queries(relay.settings.names)
        self.loop_lag = 0.0
        self._beat_at: float | None = None
        self._tasks: list[asyncio.Task[None]] = []

        r, labels = self.registry, ["table"]
        self.published = Counter(
            PREFIX + "published",
            "Rows published: acknowledged by Kafka and marked",
            [*labels, "topic"],
            registry=r,
        )
        self.failures = Counter(
            PREFIX + "publish_failures",
            "Failed attempts, by reason: rows that failed (topic_missing, malformed, too_large, "
            "not_authorized, kafka_error), rows given back while Kafka was unavailable "
            "(kafka_unavailable), claims that failed on the database (database), claims "
            "ended because the relay stalled past their idle timeout, or its process did not "
            "run for its pulse's tolerance, frozen_relay_timeout or more (claim_lost)",
            [*labels, "reason"],
            registry=r,
        )
        self.retries = Counter(
            PREFIX + "retries", "Rows scheduled for a retry", [*labels, "topic"], registry=r
        )
        self.dead_lettered = Counter(
            PREFIX + "dead_lettered",
            "Rows moved to the dead-letter table",
            [*labels, "topic"],
            registry=r,
        )
        self.commit_to_ack = Histogram(
            PREFIX + "commit_to_ack_seconds",
            "From a row's created_at (its transaction's start) to its Kafka ack, as marked",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            PREFIX + "claim_batch_size",
            "Rows per claim that got any",
            labels,
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.frozen_claims_ended = Counter(
            PREFIX + "frozen_claims_ended",
            "Claims of other relays this relay's pulse ended: idle in their transaction while "
            "their relay's process did not run for its tolerance, frozen_relay_timeout or more "
            "(pulse.py)",
            labels,
            registry=r,
        )
        self.wakeups = Counter(
            PREFIX + "wakeups",
            "Wake-ups of the workers, by source",
            [*labels, "source"],
            registry=r,
        )
        self.stats_errors = Counter(
            PREFIX + "stats_errors",
            "Failed reads of the table gauges (pending, oldest, dead letters)",
            labels,
            registry=r,
        )
        for reason in FAILURE_REASONS:
            self.failures.labels(self.table, reason)
        # Exactly-once delivery's own counters, only where it runs: at-least-once relays
        # export no series that can never move.
        self._eos: dict[str, Any] = {}
        if relay.settings.delivery == "exactly-once":
            self._eos_counters(r, labels)
        # Labelled children by label values: prometheus_client's labels() validates and looks
        # them up under a lock at every call, a few per claim on the hot path.
        self._children: dict[tuple[object, ...], Any] = {}
        self.registry.register(_StateCollector(self))
        relay.events.add_hook(self._on_event)
        relay.events.add_batch_observer(self._on_batch)

    def _eos_counters(self, r: CollectorRegistry, labels: list[str]) -> None:
        transactions = Counter(
            PREFIX + "transactions",
            "Kafka transactions of the exactly-once relay, by outcome: committed (a batch "
            "and its marker), aborted (a record refused, Kafka unavailable)",
            [*labels, "outcome"],
            registry=r,
        )
        recoveries = Counter(
            PREFIX + "recoveries",
            "Batches in flight of a slot (after a crash, a freeze, or a commit whose outcome "
            "was unknown) settled from the marker topic, by what the markers said: committed "
            "(marked published, not sent again) or aborted (sent again)",
            [*labels, "outcome"],
            registry=r,
        )
        self._eos = {
            "eos_committed": transactions.labels(self.table, "committed"),
            "eos_aborted": transactions.labels(self.table, "aborted"),
            "eos_recovered_committed": recoveries.labels(self.table, "committed"),
            "eos_recovered_aborted": recoveries.labels(self.table, "aborted"),
        }
        for event, name, doc in (
            (
                "eos_fence",
                "fences",
                "Transactional producers started for a slot: each fences the slot's earlier "
                "producer and ends its open transaction",
            ),
            ("eos_leased", "slot_leases", "Slot leases taken by this relay"),
            (
                "eos_slot_lost",
                "slots_lost",
                "Slots this relay lost: their lease taken over (the relay did not renew it in "
                "time) or their producer fenced by another",
            ),
        ):
            self._eos[event] = Counter(PREFIX + name, doc, labels, registry=r).labels(self.table)

    # --- lifecycle (the background refresh, for registries scraped without http.py) ---------

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def start(self, *, refresh: bool = True) -> None:
        """Start the event-loop heartbeat (``/livez``, loop lag) and, with ``refresh``, a task
        that reads the table gauges every ``stats_interval`` seconds (an application whose
        registry is scraped by a server of its own needs it; ``http.py`` refreshes on
        demand instead, so an unscraped relay costs the database nothing)."""
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="notify-outbox-heartbeat"))
        if refresh:
            self._tasks.append(
                asyncio.create_task(self._refresh_loop(), name="notify-outbox-stats")
            )

    async def aclose(self) -> None:
        """Stop the background tasks and close the stats connection."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._conn is not None:
            await terminate(self._conn)
            self._conn = None

    async def _heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            expected = loop.time() + _HEARTBEAT
            await asyncio.sleep(_HEARTBEAT)
            self.loop_lag = max(0.0, loop.time() - expected)
            self._beat_at = loop.time()

    async def _refresh_loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.stats_interval)

    # --- event-driven metrics --------------------------------------------------------------

    def _topic(self, topic: str) -> str:
        if topic in self._topics:
            return topic
        if len(self._topics) < self._max_topics:
            self._topics.add(topic)
            return topic
        return OTHER_TOPIC

    def _child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(self.table, *values)``, looked up once."""
        key = (id(metric), *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self.table, *values)
        return child

    def _on_event(self, name: str, amount: int) -> None:
        if name.startswith("wake:"):
            source = name[5:]
            self._child(self.wakeups, source if source in WAKE_SOURCES else "other").inc(amount)
        elif name == "claimed":
            self._child(self.batch_size).observe(amount)
        elif name == "db_error":
            self.failures.labels(self.table, "database").inc(amount)
        elif name == "claim_lost":
            self.failures.labels(self.table, "claim_lost").inc(amount)
        elif name == "reaped":
            self.frozen_claims_ended.labels(self.table).inc(amount)
        elif (eos := self._eos.get(name)) is not None:
            eos.inc(amount)

    def _on_batch(
        self, rows: Sequence[OutboxRow], outcome: BatchOutcome, unavailable: str | None
    ) -> None:
        now = time.time()
        # Every row published, the common case: no look-up by id (nothing retried or dead).
        everything = len(outcome.published) == len(rows)
        by_id = {} if everything else {row.id: row for row in rows}
        published: Tally[str] = Tally()
        latency = self._child(self.commit_to_ack)
        for row in rows if everything else [by_id[i] for i in outcome.published]:
            published[row.topic] += 1
            if row.created_at is not None:
                # Clocks of two hosts: never report a negative latency.
                latency.observe(max(0.0, now - row.created_at.timestamp()))
        self._add(self.published, published)
        failures: Tally[str] = Tally()
        retried: Tally[str] = Tally()
        for row_id, reason, _delay in outcome.retry:
            retried[by_id[row_id].topic] += 1
            failures[failure_class(reason)] += 1
        dead: Tally[str] = Tally()
        for row_id, reason in outcome.dead:
            dead[by_id[row_id].topic] += 1
            failures[failure_class(reason)] += 1
        self._add(self.retries, retried)
        self._add(self.dead_lettered, dead)
        if unavailable is not None:
            settled = len(outcome.published) + len(outcome.retry) + len(outcome.dead)
            failures["kafka_unavailable"] += len(rows) - settled
        for reason, n in failures.items():
            if n:
                self.failures.labels(self.table, reason).inc(n)

    def _add(self, counter: Counter, by_topic: Tally[str]) -> None:
        for topic, n in by_topic.items():
            self._child(counter, self._topic(topic)).inc(n)

    # --- the table gauges --------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the table gauges unless they are younger than ``stats_interval``; concurrent
        callers share one read. Failures are counted and logged at DEBUG; the last values are
        kept (and ``notify_outbox_stats_age_seconds`` grows)."""
        if self._stats_at is not None and time.monotonic() - self._stats_at < self.stats_interval:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self._read_stats())
        await asyncio.shield(self._refreshing)

    def set_stats(self, stats: OutboxStats | None, error: str | None = None) -> None:
        """Table gauges read by someone else (a fleet reads all its outboxes' in one
        statement): ``stats``, or the ``error`` of the failed read."""
        now = time.monotonic()
        self._stats_at = now
        if error is not None:
            self.stats_errors.labels(self.table).inc()
            return
        self.stats = stats
        self._stats_ok_at = now

    async def _read_stats(self) -> None:
        try:
            self.stats = await self._stats_source()
        except DATABASE_ERRORS as e:
            self.stats_errors.labels(self.table).inc()
            log.debug(
                "reading the table gauges failed: %s",
                redact(str(e) or type(e).__name__, self.relay.settings),
            )
            if self._conn is not None:
                await terminate(self._conn)
                self._conn = None
            # Retry at the next scrape or interval, not at once.
            self._stats_at = time.monotonic()
            return
        self._stats_at = self._stats_ok_at = time.monotonic()

    async def _query_stats(self) -> OutboxStats:
        s = self.relay.settings
        if self._conn is None or self._conn.is_closed():
            self._conn = await asyncpg.connect(
                s.dsn.get_secret_value(),
                timeout=s.db_command_timeout,
                command_timeout=s.db_command_timeout,
                # Works through a transaction-pooling PgBouncer too.
                statement_cache_size=0,
                server_settings=session_parameters("notify-outbox-metrics"),
            )
        row = await self._conn.fetchrow(
            self._queries["metrics_stats"], STATS_LIMIT, *self.relay.low_water_mark.args()
        )
        assert row is not None
        return OutboxStats(
            pending=min(int(row["pending"]), STATS_LIMIT),
            oldest_pending_seconds=row["oldest_pending_seconds"],
            dead_lettered=int(row["dead_lettered"]),
        )

    # --- state -------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        """Whether the relay has connected to both and its workers run."""
        return self.relay.events.counts["wake:start"] > 0

    def _down(self, dependency: str) -> bool:
        """Whether the relay's publishing outage is ``dependency``'s ("Kafka", or the Schema
        Registry when the rows' schemas could not be loaded)."""
        outage = self.relay.kafka_outage
        return outage.active and outage.dependency == dependency

    def components(self) -> dict[str, bool]:
        """Up or down, per dependency: database, kafka, schema_registry (when one is set) and
        (unless poll-only) listener."""
        relay = self.relay
        db_outage = relay.db_outage
        database = not db_outage.active or (
            # The relay notices that PostgreSQL is back only at its next claim; a later
            # successful read of the gauges is proof enough.
            self._stats_ok_at is not None
            and db_outage.started is not None
            and self._stats_ok_at > db_outage.started
        )
        up = {
            "database": self.started and database,
            "kafka": self.started and not self._down("Kafka"),
        }
        if relay.settings.schema_registry_url:
            up["schema_registry"] = self.started and not self._down(SCHEMA_REGISTRY)
        if not relay.settings.poll_only:
            listener = relay.listener
            conn = listener.connection if listener is not None else None
            up["listener"] = conn is not None and not conn.is_closed()
        return up

    @property
    def stale_database(self) -> bool:
        """Whether the relay knows of a PostgreSQL outage (``/readyz`` then reads the gauges
        afresh, which tells whether it is over)."""
        return self.relay.db_outage.active

    def readiness(self) -> Readiness:
        """Ready: started, not stopping, and every dependency up (listener: or poll-only)."""
        relay = self.relay
        checks: dict[str, str] = {}
        if relay.outcome != "running":
            checks["relay"] = f"stopped ({relay.outcome})"
        elif not self.started:
            checks["relay"] = "starting: connecting to PostgreSQL and Kafka"
        else:
            checks["relay"] = "ok"
        up = self.components()
        checks["database"] = "ok" if up["database"] else "unreachable"
        if self._down("Kafka"):
            checks["kafka"] = "unavailable (does not answer)"
        else:
            checks["kafka"] = "ok" if up["kafka"] else "not connected yet"
        if "schema_registry" in up:
            if self._down(SCHEMA_REGISTRY):
                checks["schema_registry"] = "unavailable (does not answer)"
            else:
                checks["schema_registry"] = "ok" if up["schema_registry"] else "not connected yet"
        if relay.settings.poll_only:
            checks["listener"] = "poll-only"
        else:
            checks["listener"] = "ok" if up["listener"] else "not listening (reconnecting)"
        if checks["database"] != "ok" and not self.started:
            checks["database"] = "not connected yet"
        if self.started:
            checks.update(relay.readiness_checks())
        ready = all(v in _FINE for v in checks.values())
        return Readiness(ready, checks)

    def liveness(self) -> tuple[bool, float]:
        """Whether the event loop answers in time, and its latest lag in seconds."""
        return self.loop_lag < LOOP_LAG_LIMIT, self.loop_lag


class _StateCollector(Collector):
    """Gauges read at scrape time from the relay's state and the cached table stats."""

    def __init__(self, metrics: RelayMetrics) -> None:
        self._m = metrics

    def describe(self) -> Iterable[Metric]:
        return list(self._families(self._m.relay.state_gauges()))

    def collect(self) -> Iterable[Metric]:
        m = self._m
        gauges = m.relay.state_gauges()
        families = {f.name: f for f in self._families(gauges)}
        table = m.table
        for component, up in m.components().items():
            families[PREFIX + "up"].add_metric([table, component], float(up))
        families[PREFIX + "event_loop_lag_seconds"].add_metric([table], m.loop_lag)
        for name, value in gauges.items():
            families[PREFIX + name].add_metric([table], value)
        stats = m.stats
        if stats is not None:
            families[PREFIX + "pending_events"].add_metric([table], stats.pending)
            oldest = stats.oldest_pending_seconds
            families[PREFIX + "oldest_pending_age_seconds"].add_metric(
                [table], 0.0 if oldest is None or math.isnan(oldest) else max(0.0, oldest)
            )
            families[PREFIX + "dead_letter_events"].add_metric([table], stats.dead_lettered)
        if m._stats_at is not None and m._stats_ok_at is not None:
            families[PREFIX + "stats_age_seconds"].add_metric(
                [table], time.monotonic() - m._stats_ok_at
            )
        return list(families.values())

    def _families(self, gauges: Iterable[str]) -> Iterator[GaugeMetricFamily]:
        """The families this relay exports; of ``STATE_GAUGES``, those in ``gauges``."""
        t = ["table"]
        yield GaugeMetricFamily(
            PREFIX + "up",
            "1 while a dependency is reachable: database, kafka, schema_registry (absent "
            "without one), listener (the LISTEN connection; absent when poll-only)",
            labels=[*t, "component"],
        )
        for name in gauges:
            yield GaugeMetricFamily(PREFIX + name, STATE_GAUGES[name], labels=t)
        yield GaugeMetricFamily(
            PREFIX + "event_loop_lag_seconds",
            "How late the event loop's last heartbeat came",
            labels=t,
        )
        yield GaugeMetricFamily(
            PREFIX + "pending_events",
            f"Rows not yet published (counted up to {STATS_LIMIT})",
            labels=t,
        )
        yield GaugeMetricFamily(
            PREFIX + "oldest_pending_age_seconds",
            "Age of the pending row with the smallest id (0 when none is pending)",
            labels=t,
        )
        yield GaugeMetricFamily(
            PREFIX + "dead_letter_events",
            f"Rows in the dead-letter table (counted up to {STATS_LIMIT})",
            labels=t,
        )
        yield GaugeMetricFamily(
            PREFIX + "stats_age_seconds",
            "Seconds since the table gauges were last read successfully",
            labels=t,
        )
