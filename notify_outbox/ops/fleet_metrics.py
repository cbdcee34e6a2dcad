"""Prometheus metrics and health of a ``Fleet`` (many outboxes, one process: issue #34).

Each outbox's relay gets the series of a single relay (``RelayMetrics``), labelled by its
outbox (``table="tenant_a.outbox"``; prefixed ``1:`` by the database's index when the fleet
serves several), up to ``max_outboxes`` of them: past that many, further outboxes add up under
``table="_other"`` (a bound on the series exported, as ``_other`` bounds the topics). Across
outboxes, aggregate with ``sum without (table) (...)``.

The table gauges (pending, oldest pending, dead letters) of every labelled outbox of a
database come from one statement (a ``UNION ALL`` of each one's ``metrics_stats``) on the
fleet's pool, at most once per ``stats_interval``, however many scrapers ask.

``/readyz`` is ready while the fleet delivers (Kafka answers, every database's listener
listens); outboxes that cannot be served are listed under ``checks.outboxes`` without making
the process unready (one tenant's broken schema must not restart the pod serving the others).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from notify_outbox.core.events import RelayEvents
from notify_outbox.core.logs import redact
from notify_outbox.core.settings import OutboxSettings
from notify_outbox.pg.db import DATABASE_ERRORS
from notify_outbox.pg.sqlfiles import Queries
from notify_outbox.pg.store import LowWaterMark
from notify_outbox.relay.fleet import Fleet
from notify_outbox.relay.listener import Listener
from notify_outbox.relay.outage import Outage
from notify_outbox.relay.relay import Relay

from .metrics import (
    _FINE,
    _HEARTBEAT,
    LOOP_LAG_LIMIT,
    STATS_LIMIT,
    OutboxStats,
    Readiness,
    RelayMetrics,
    log,
)

__all__ = ["OTHER_OUTBOXES", "FleetMetrics"]

#: The ``table`` label of the outboxes past ``max_outboxes``.
OTHER_OUTBOXES = "_other"
MAX_OUTBOXES = 100
_PARAM = re.compile(r"\$([234])\b")
_READ_ERRORS: tuple[type[BaseException], ...] = (*DATABASE_ERRORS, ConnectionError)


def _shift(base: int) -> Callable[[re.Match[str]], str]:
    """An outbox's $2..$4 (its low-water mark) as $base+1..$base+3 of the union."""
    return lambda m: f"${base + int(m.group(1)) - 1}"


class _Overflow:
    """The outboxes past the label cap, seen as one relay by ``RelayMetrics``: their events
    added up (a ``MonitoredRelay``)."""

    def __init__(self, fleet: Fleet) -> None:
        self.settings: OutboxSettings = fleet.settings
        self.events = RelayEvents()
        self.outcome: str | None = "running"
        self.kafka_outage: Outage = fleet.kafka_outage
        self.db_outage = Outage("PostgreSQL", log)
        self.listener: Listener | None = None
        self.low_water_mark = LowWaterMark()

    def state_gauges(self) -> dict[str, float]:
        return {}

    def readiness_checks(self) -> dict[str, str]:
        return {}


class FleetMetrics:
    """The collectors of every outbox of ``fleet``, in ``registry`` (default a new one); see
    the module docstring."""

    def __init__(
        self,
        fleet: Fleet,
        registry: CollectorRegistry | None = None,
        *,
        max_outboxes: int = MAX_OUTBOXES,
        stats_interval: float = 5.0,
    ) -> None:
        self.fleet = fleet
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.stats_interval = stats_interval
        self.loop_lag = 0.0
        self._max = max_outboxes
        self._members: dict[str, tuple[int, Relay, RelayMetrics]] = {}
        self._overflow: RelayMetrics | None = None
        self._overflowing: set[str] = set()
        self._stats_at: float | None = None
        self._refreshing: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.registry.register(_Merged(self))
        fleet.add_member_observer(self._on_member)

    # --- outboxes come and go ------------------------------------------------------------------

    def _on_member(self, label: str, database: int, relay: Relay | None) -> None:
        if relay is None:
            self._members.pop(label, None)
            self._overflowing.discard(label)
            return
        if len(self._members) < self._max:
            metrics = RelayMetrics(
                relay,
                CollectorRegistry(auto_describe=False),
                stats_interval=self.stats_interval,
                table=label,
            )
            self._members[label] = (database, relay, metrics)
            return
        if self._overflow is None:
            self._overflow = RelayMetrics(
                _Overflow(self.fleet),
                CollectorRegistry(auto_describe=False),
                table=OTHER_OUTBOXES,
            )
        sink = self._overflow.relay.events
        relay.events.add_hook(sink.emit)
        relay.events.add_batch_observer(sink.report_batch)
        self._overflowing.add(label)

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self, *, refresh: bool = True) -> None:
        """Start the event-loop heartbeat (``/livez``) and, with ``refresh``, a task reading
        the table gauges every ``stats_interval`` (``http.py`` reads them when scraped)."""
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="notify-outbox-heartbeat"))
        if refresh:
            self._tasks.append(asyncio.create_task(self._refresh_loop(), name="fleet-stats"))

    async def aclose(self) -> None:
        """Stop the background tasks."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            expected = loop.time() + _HEARTBEAT
            await asyncio.sleep(_HEARTBEAT)
            self.loop_lag = max(0.0, loop.time() - expected)
            for _, _, metrics in self._members.values():
                metrics.loop_lag = self.loop_lag

    async def _refresh_loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.stats_interval)

    # --- the table gauges --------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the table gauges of every labelled outbox unless they are younger than
        ``stats_interval``: one statement per database; concurrent callers share it."""
        if self._stats_at is not None and time.monotonic() - self._stats_at < self.stats_interval:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self._read_all())
        await asyncio.shield(self._refreshing)

    async def _read_all(self) -> None:
        by_database: dict[int, list[tuple[Relay, RelayMetrics]]] = {}
        for database, relay, metrics in list(self._members.values()):
            by_database.setdefault(database, []).append((relay, metrics))
        for database, members in by_database.items():
            await self._read(database, members)
        self._stats_at = time.monotonic()

    async def _read(self, database: int, members: list[tuple[Relay, RelayMetrics]]) -> None:
        parts: list[str] = []
        args: list[object] = [STATS_LIMIT]
        for i, (relay, _) in enumerate(members):
            sql = Queries(relay.settings.names)["metrics_stats"].strip().rstrip(";")
            sql = _PARAM.sub(_shift(len(args)), sql)
            parts.append(f"SELECT {i} AS o, s.* FROM ({sql}) AS s")
            args.extend(relay.low_water_mark.args())
        try:
            async with self.fleet.acquire(database) as conn:
                rows = await conn.fetch(" UNION ALL ".join(parts), *args)
        except _READ_ERRORS as e:
            reason = redact(str(e) or type(e).__name__, self.fleet.settings)
            log.debug("reading the table gauges failed: %s", reason)
            for _, metrics in members:
                metrics.set_stats(None, reason)
            return
        for row in rows:
            _, metrics = members[row["o"]]
            oldest = row["oldest_pending_seconds"]
            metrics.set_stats(
                OutboxStats(
                    pending=min(int(row["pending"]), STATS_LIMIT),
                    oldest_pending_seconds=None if oldest is None or math.isnan(oldest) else oldest,
                    dead_lettered=int(row["dead_lettered"]),
                )
            )

    # --- health ------------------------------------------------------------------------------

    @property
    def stale_database(self) -> bool:
        """Whether an outbox's relay knows of a PostgreSQL outage (``/readyz`` then reads the
        gauges afresh, which tells whether it is over)."""
        return any(relay.db_outage.active for _, relay, _ in self._members.values())

    def readiness(self) -> Readiness:
        """Ready while the fleet delivers; the outboxes it cannot serve are listed, and do not
        make it unready."""
        fleet = self.fleet
        checks: dict[str, str] = {}
        if fleet.outcome != "running":
            checks["fleet"] = f"stopped ({fleet.outcome})"
        elif not fleet.ready and not fleet.kafka_outage.active:
            checks["fleet"] = "starting, or a listener is reconnecting"
        else:
            checks["fleet"] = "ok"
        checks["kafka"] = "unavailable" if fleet.kafka_outage.active else "ok"
        ready = all(v in _FINE for v in checks.values())
        failing = fleet.failing()
        checks["outboxes"] = (
            f"{len(fleet.outboxes)} served"
            if not failing
            else "failing: " + "; ".join(f"{t}: {why}" for t, why in sorted(failing.items()))
        )
        return Readiness(ready, checks)

    def liveness(self) -> tuple[bool, float]:
        """Whether the event loop answers in time, and its latest lag in seconds."""
        return self.loop_lag < LOOP_LAG_LIMIT, self.loop_lag


class _Merged(Collector):
    """Every outbox's families as one: the samples of families of the same name together."""

    def __init__(self, metrics: FleetMetrics) -> None:
        self._m = metrics

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        sources: list[Any] = [m.registry for _, _, m in list(self._m._members.values())]
        if self._m._overflow is not None:
            sources.append(self._m._overflow.registry)
        for registry in sources:
            for family in registry.collect():
                into = merged.get(family.name)
                if into is None:
                    merged[family.name] = family
                else:
                    into.samples.extend(family.samples)
        return list(merged.values())
