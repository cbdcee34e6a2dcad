"""One process, many outboxes (issue #34): a schema per tenant, a database per service.

A ``Fleet`` serves the outboxes of one or more databases. Each outbox keeps its own ``Relay``
(its claims, low-water mark, retries, dead letters, gate and per-key order are an outbox's and
unchanged), and what does not depend on the outbox is shared, per database:

- **one listening connection per channel** (usually one per database, whatever the number of
  outboxes): since migration 0008 a notification's payload names its outbox (``schema.table``),
  and the listener rings that outbox's relay; an empty payload (a trigger older than 0008)
  rings every outbox of the channel;
- **one pool** of ``workers + 2`` connections, so connections are bounded by settings, not by
  the number of outboxes; each outbox runs ``outbox_workers`` workers (half the pool by
  default: an outbox draining a backlog leaves the other half to the others, and the pool
  hands connections out first come, first served);
- **one fallback poll statement** every ``poll_interval``: which outboxes have unpublished
  rows at all (an ``EXISTS`` per outbox through its partial indexes); only those run their own
  poll (due rows, the next retry, a stuck parked row);
- **one pulse** (frozen relays' claims) and **one Kafka producer** for the whole process.

Discovery (``FleetDatabase.discover``) serves every migrated outbox of a database, optionally
only schemas matching a LIKE pattern, and re-checks: every ``discovery_interval`` a catalog
fingerprint rides on a poll statement (so it costs no statement of its own); ``migrate`` of a
new or upgraded outbox sends a registry notification (``REGISTRY_PAYLOAD``) on its channel; and a
notification naming an outbox it does not know triggers a re-check (at most once per
``_UNKNOWN_EVERY``). A new outbox is served without a restart; a dropped one is let go (its
relay stops gracefully: its claims finish or roll back).

Idle, a database costs the poll (0.2 statements/s at the default 5 s) and the listener's health
probe (0.1/s): 0.3 statements/s, whatever the number of outboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

import anyio
import asyncpg

from notify_outbox.core.errors import ConfigurationError, NotifyOutboxError
from notify_outbox.core.events import RelayEvents
from notify_outbox.core.logs import redact
from notify_outbox.core.names import OutboxNames
from notify_outbox.core.settings import OutboxSettings
from notify_outbox.kafka.publisher import KafkaPublisher, TokenProvider
from notify_outbox.pg.db import DATABASE_ERRORS, connect_worker_pool, settle_pool
from notify_outbox.pg.discovery import discover_outboxes, schemas_like
from notify_outbox.pg.migrations import REGISTRY_PAYLOAD

from .listener import Listener
from .outage import Outage, tame_third_party_logs
from .pulse import Pulse, worker_app
from .relay import FaultHook, Relay
from .wiring import SharedPorts, kafka_publisher

__all__ = ["REGISTRY_PAYLOAD", "Fleet", "FleetDatabase"]

log = logging.getLogger("notify_outbox.fleet")


# A notification naming an unknown outbox re-checks the registry at most this often (payloads
# are hints anyone may send: they must not make the relay query the catalog at their rate).
_UNKNOWN_EVERY = 5.0
# Outboxes per poll statement (PostgreSQL's plan for a union of thousands would be slow to make).
_POLL_CHUNK = 500
# A draining outbox pauses (outbox_drain_share) while another outbox had events this recently,
# and for at most this long at a time; its claims then take at most _SHARED_CLAIM rows (a claim
# or mark of 1,000 rows is a 15-18 ms statement the others' statements wait behind).
_ACTIVE_WINDOW = 1.0
_PACE_MAX = 1.0
_SHARED_CLAIM = 100

# The fingerprint of the database's outboxes: every table with a notify trigger of its own
# name. It changes when an outbox is migrated (0001 creates the trigger) or dropped.
_FINGERPRINT = """
(SELECT md5(coalesce(string_agg(n.nspname || '.' || c.relname, ','
                                ORDER BY n.nspname, c.relname), ''))
 FROM pg_trigger AS g
 JOIN pg_class AS c ON c.oid = g.tgrelid
 JOIN pg_namespace AS n ON n.oid = c.relnamespace
 WHERE g.tgname = c.relname || '_notify' AND NOT g.tgisinternal)
"""


@dataclass(frozen=True)
class FleetDatabase:
    """One database of a fleet and which of its outboxes to serve.

    ``settings``: the database's DSN (``listen_dsn``, ``channel`` for outboxes listed by name)
    and every relay setting, shared by its outboxes (``db_schema`` and ``table`` are not used).
    ``outboxes``: the outboxes to serve, by name; or ``discover``: every migrated outbox of
    the database (with ``schemas_like``, only schemas whose name matches that SQL LIKE
    pattern; with ``table``, only tables of that name), re-checked while running.
    """

    settings: OutboxSettings
    outboxes: tuple[OutboxNames, ...] = ()
    discover: bool = False
    schemas_like: str | None = None
    table: str | None = None

    @classmethod
    def from_settings(cls, settings: OutboxSettings) -> FleetDatabase:
        """The database and outboxes of ``settings.outboxes`` (``*``: discovery, with
        ``outbox_schemas_like``; else the listed ``schema.table`` on ``settings.channel``)."""
        if settings.outboxes is None:
            raise ConfigurationError("NOTIFY_OUTBOX_OUTBOXES is not set: a single outbox")
        if settings.outboxes == "*":
            return cls(settings, discover=True, schemas_like=settings.outbox_schemas_like)
        listed = []
        for target in settings.outboxes.split(","):
            schema, _, table = target.partition(".")
            listed.append(OutboxNames(schema, table, settings.channel))
        return cls(settings, outboxes=tuple(listed))

    def __post_init__(self) -> None:
        if self.discover == bool(self.outboxes):
            raise ConfigurationError(
                "a fleet database needs either a list of outboxes or discover=True (not both)"
            )
        if self.settings.delivery != "at-least-once":
            raise ConfigurationError(
                "a relay serving many outboxes runs at-least-once delivery only for now: run "
                "one exactly-once relay per outbox (NOTIFY_OUTBOX_DELIVERY=exactly-once)"
            )


#: ``observer(label, database, relay or None)``: see ``Fleet.add_member_observer``.
MemberObserver = Callable[[str, int, "Relay | None"], None]


@dataclass
class _Member:
    relay: Relay
    names: OutboxNames
    done: anyio.Event = field(default_factory=anyio.Event)


class _Activity:
    """Which outboxes had events last (the two latest, and when), so that a draining one
    can ask in O(1) whether any other had some within ``window`` seconds."""

    def __init__(self, window: float = _ACTIVE_WINDOW) -> None:
        self.window = window
        self._last: tuple[object, float] = (None, -math.inf)
        self._before: tuple[object, float] = (None, -math.inf)

    def note(self, who: object, now: float) -> None:
        if self._last[0] is not who:
            self._before = self._last
        self._last = (who, now)

    def others(self, who: object, now: float) -> bool:
        """Whether an outbox other than ``who`` had events within the window."""
        other = self._before if self._last[0] is who else self._last
        return now - other[1] <= self.window


def pause_for(busy: float, share: float) -> float:
    """Seconds a worker pauses after a claim that took ``busy`` seconds, so that it claims
    for ``share`` of the time (at most ``_PACE_MAX``)."""
    return min(busy * (1.0 / share - 1.0), _PACE_MAX)


class Fleet:
    """Moves committed rows of many outboxes to Kafka: every promise of ``Relay``, per outbox.

    Embedded use::

        async with Fleet([FleetDatabase(settings, discover=True)]) as fleet:
            ...  # fleet.outboxes: the outboxes served now

    ``outbox_workers``: workers per outbox (default: half of ``settings.workers``, at least
    1); ``settings.workers`` bounds the database's pool (``workers + 2`` connections).
    ``discovery_interval``: how often a discovering database re-checks its outboxes.
    """

    def __init__(
        self,
        databases: Sequence[FleetDatabase],
        *,
        outbox_workers: int | None = None,
        discovery_interval: float = 60.0,
        kafka_token_provider: TokenProvider | None = None,
        fault_hook: FaultHook | None = None,
    ) -> None:
        if not databases:
            raise ConfigurationError("a fleet needs at least one database")
        self.settings = databases[0].settings
        #: Every outbox's events, added up (the counts of all relays of the fleet).
        self.events = RelayEvents()
        self.relay_id = secrets.token_hex(4)
        self.kafka_outage = Outage("Kafka", log)
        self.outcome = "running"
        self._kafka_token_provider = kafka_token_provider
        self._fault_hook = fault_hook
        self._discovery_interval = discovery_interval
        self._outbox_workers = outbox_workers
        self._drain_share = self.settings.outbox_drain_share
        self._databases = [_Database(self, spec) for spec in databases]
        self._publisher: KafkaPublisher | None = None
        self._stopping = False
        self._stop_requested = anyio.Event()
        self._ready = anyio.Event()
        self._task: asyncio.Task[None] | None = None
        self._observers: list[MemberObserver] = []

    # --- what it serves -----------------------------------------------------------------------

    @property
    def outboxes(self) -> list[str]:
        """The outboxes served now, as ``schema.table`` (prefixed by the database's index and
        a colon when the fleet has more than one database)."""
        many = len(self._databases) > 1
        return sorted(
            (f"{i}:{t}" if many else t) for i, db in enumerate(self._databases) for t in db.members
        )

    @property
    def databases(self) -> int:
        """How many databases the fleet serves."""
        return len(self._databases)

    def members(self) -> list[tuple[str, int, Relay]]:
        """The relays serving now: (label as in ``outboxes``, database index, relay)."""
        many = len(self._databases) > 1
        return [
            (f"{i}:{t}" if many else t, i, m.relay)
            for i, db in enumerate(self._databases)
            for t, m in sorted(db.members.items())
        ]

    def add_member_observer(self, observer: MemberObserver) -> None:
        """Call ``observer(label, database, relay)`` for each outbox's relay when it starts
        (and now, for those running), and ``observer(label, database, None)`` when it ends
        (``ops/fleet_metrics.py`` keeps a metrics set per outbox with it)."""
        self._observers.append(observer)
        for label, i, relay in self.members():
            observer(label, i, relay)

    def _member_changed(self, database: _Database, target: str, relay: Relay | None) -> None:
        i = self._databases.index(database)
        label = f"{i}:{target}" if len(self._databases) > 1 else target
        for observer in self._observers:
            observer(label, i, relay)

    def acquire(self, database: int) -> asyncpg.pool.PoolAcquireContext:
        """A connection of the ``database``-th database's pool (``async with``), for a read
        beside the relays (the metrics' table gauges). Raises ConnectionError before the
        fleet has connected."""
        pool = self._databases[database]._pool
        if pool is None:
            raise ConnectionError("not connected yet")
        return pool.acquire(timeout=self.settings.db_command_timeout)

    def relay(self, target: str, database: int = 0) -> Relay | None:
        """The relay of outbox ``target`` (``schema.table``) of the ``database``-th database,
        if it is served now."""
        member = self._databases[database].members.get(target)
        return None if member is None else member.relay

    def failing(self) -> dict[str, str]:
        """Outboxes that do not deliver now, and why (for ``/readyz``): one that could not
        start (not migrated, a delivery mode of the other kind) or whose statements fail."""
        many = len(self._databases) > 1
        out: dict[str, str] = {}
        for i, db in enumerate(self._databases):
            for target, reason in db.failing_now().items():
                out[f"{i}:{target}" if many else target] = reason
        return out

    @property
    def ready(self) -> bool:
        """Started, not stopping, Kafka answering, and every database's listener listening
        (a failing outbox does not make the fleet unready: see ``failing()``)."""
        return (
            self._ready.is_set()
            and not self._stopping
            and not self.kafka_outage.active
            and all(db.listening for db in self._databases)
        )

    async def rediscover(self) -> None:
        """Look for new and dropped outboxes of every discovering database now."""
        for db in self._databases:
            if db.spec.discover:
                await db.refresh()

    # --- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Start the fleet as a task and return once every database is served (its pool,
        listener and first discovery done, its outboxes' relays started)."""
        self._task = asyncio.create_task(self.run(), name="notify-outbox-fleet")
        try:
            await self.wait_ready()
        except BaseException:
            self.request_stop()
            with contextlib.suppress(BaseException):
                await asyncio.shield(self._task)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def wait_ready(self) -> None:
        """Wait until every database is served; raises what ended the run before that."""
        task = self._task
        if task is None:
            await self._ready.wait()
            return
        ready = asyncio.ensure_future(self._ready.wait())
        try:
            await asyncio.wait([ready, task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if self._ready.is_set():
            return
        task.result()
        raise NotifyOutboxError(f"the fleet stopped before it was ready ({self.outcome})")

    def request_stop(self) -> None:
        """Stop every outbox's relay gracefully (in-flight batches finish), then exit."""
        if self._stopping:
            return
        self._stopping = True
        for db in self._databases:
            db.stop_members()
        self._stop_requested.set()

    def abort(self) -> None:
        """Stop now: every relay's in-flight claims roll back (their rows stay pending)."""
        self._stopping = True
        for db in self._databases:
            for member in list(db.members.values()):
                member.relay.abort()
        self._stop_requested.set()
        if self.outcome == "running":
            self.outcome = "aborted"

    async def stop(self) -> None:
        """Graceful stop; returns when the fleet has exited."""
        self.request_stop()
        if self._task is not None:
            await self._task

    async def run(self) -> None:
        """Serve every database until ``request_stop()``/``abort()`` or cancellation."""
        try:
            with tame_third_party_logs():
                await self._run()
        except BaseException:
            if self.outcome == "running":
                self.outcome = "failed"
            raise
        if self.outcome == "running":
            self.outcome = "stopped"

    async def _run(self) -> None:
        kafka = kafka_publisher(self.settings, self._kafka_token_provider)
        self._publisher = kafka
        try:
            # A first start fails on settings Kafka refuses (credentials, TLS): exit, and
            # say why, rather than retry forever.
            if not await self._until_stopped(kafka.start(fatal=True)):
                return
            async with anyio.create_task_group() as services:
                services.start_soon(self._remind_outages, name="outage-reminders")
                services.start_soon(self._watch_kafka, name="kafka-watch")
                async with anyio.create_task_group() as databases:
                    for db in self._databases:
                        databases.start_soon(db.run, name="fleet-database")
                    for db in self._databases:
                        await db.started.wait()
                    if not self._stopping:
                        self._ready.set()
                        log.info(
                            "fleet running: %d outboxes of %d database(s), Kafka %s",
                            len(self.outboxes),
                            len(self._databases),
                            self.settings.kafka_bootstrap_servers,
                        )
                # Every database has stopped its relays (after a stop was asked).
                services.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await kafka.stop(self.settings.shutdown_timeout)

    async def _until_stopped(self, coro: object) -> bool:
        """Run ``coro`` unless a stop comes first; whether it finished."""
        finished = False
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await self._stop_requested.wait()
                tg.cancel_scope.cancel()

            async def work() -> None:
                nonlocal finished
                await coro  # type: ignore[misc]
                finished = True
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            tg.start_soon(work)
        return finished

    async def _watch_kafka(self) -> None:
        """While no relay of the fleet is busy, ask Kafka now and then whether it answers (as
        a single relay does): an outage shows in the log and /readyz when it starts."""
        publisher = self._publisher
        assert publisher is not None
        while True:
            await anyio.sleep(self.settings.kafka_idle_check_interval)
            busy = any(relay.busy_workers for _, _, relay in self.members())
            if busy or (publisher.available and await publisher.check()):
                continue
            self.events.emit("kafka_unavailable")
            self.kafka_outage.failed("Kafka stopped answering")
            await publisher.wait_available()
            if self.kafka_outage.active:
                self.kafka_outage.recovered(None)
                self.events.emit("kafka_back")

    async def _remind_outages(self) -> None:
        while True:
            await anyio.sleep(1.0)
            self.kafka_outage.remind()
            for db in self._databases:
                for member in db.members.values():
                    member.relay.db_outage.remind()

    def _pacer(
        self, member: _Member, activity: _Activity
    ) -> Callable[[float], Awaitable[None]] | None:
        """The pause of ``member``'s workers after a full claim (``outbox_drain_share``):
        while another outbox of its database had events within ``_ACTIVE_WINDOW``
        (``activity``), the drain claims for its share of the time only. None when the share
        is 1. Per database: what a drain slows down is its database (its WAL, its CPUs)."""
        share = self._drain_share
        if share >= 1.0:
            return None

        async def pace(busy: float) -> None:
            if activity.others(member, time.monotonic()):
                self.events.emit("drain_paused")
                await anyio.sleep(pause_for(busy, share))

        return pace

    def _limiter(self, member: _Member, activity: _Activity) -> Callable[[], int | None] | None:
        """``member``'s claim size while another outbox of its database had events within
        ``_ACTIVE_WINDOW``: ``_SHARED_CLAIM`` rows (None: its batch size). None when
        ``outbox_drain_share`` is 1."""
        if self._drain_share >= 1.0:
            return None
        shared = min(_SHARED_CLAIM, member.relay.settings.batch_size)

        def limit() -> int | None:
            return shared if activity.others(member, time.monotonic()) else None

        return limit

    def _member_settings(self, base: OutboxSettings, names: OutboxNames) -> OutboxSettings:
        workers = self._outbox_workers or max(1, base.workers // 2)
        return base.model_copy(
            update={
                "db_schema": names.schema,
                "table": names.table,
                "channel": names.channel,
                "workers": workers,
            }
        )


class _Database:
    """One database of a fleet: its pool, listeners, pulse, poll and outboxes' relays."""

    def __init__(self, fleet: Fleet, spec: FleetDatabase) -> None:
        self.fleet = fleet
        self.spec = spec
        self.settings = spec.settings
        self.members: dict[str, _Member] = {}
        self.started = anyio.Event()
        self._failed: dict[str, str] = {}  # outboxes whose relay could not run, and why
        self._pool: asyncpg.Pool | None = None
        self._behind_pooler = False
        self._pulse: Pulse | None = None
        self._listeners: dict[str, Listener] = {}
        self._listening: dict[str, anyio.Event] = {}
        self._services: anyio.abc.TaskGroup | None = None
        self._relays: anyio.abc.TaskGroup | None = None
        self._refresh_lock = anyio.Lock()
        self._refresh_asked = anyio.Event()
        self._unknown_at = -1e9
        # Outboxes found but not served (outside schemas_like; their relay failed): their
        # notifications must not re-check the catalog every _UNKNOWN_EVERY.
        self._ignored: set[str] = set()
        self._fingerprint: str | None = None
        self._poll_sql: dict[tuple[str, ...], list[str]] = {}
        self._poll_failing: str | None = None
        #: Which of its outboxes had events last (outbox_drain_share).
        self.activity = _Activity()

    @property
    def listening(self) -> bool:
        """Whether every channel's listener has a working session (always, poll-only)."""
        return all(listener.connection is not None for listener in self._listeners.values())

    def failing_now(self) -> dict[str, str]:
        out = dict(self._failed)
        for target, member in self.members.items():
            if member.relay.db_outage.active:
                out[target] = f"PostgreSQL: {member.relay.db_outage.dependency} failing"
        if self._poll_failing is not None:
            out["*"] = self._poll_failing
        return out

    def stop_members(self) -> None:
        for member in list(self.members.values()):
            member.relay.request_stop()

    async def run(self) -> None:
        s = self.settings
        connected = await self.fleet._until_stopped(self._connect())
        if not connected:
            self.started.set()
            return
        assert self._pool is not None
        try:
            if s.frozen_relay_timeout > 0 and not self._behind_pooler:
                self._pulse = Pulse(
                    s.dsn.get_secret_value(),
                    self.fleet.relay_id,
                    s.frozen_relay_timeout,
                    command_timeout=s.db_command_timeout,
                    on_reaped=self._after_reap,
                )
                self._pulse.start()
            async with anyio.create_task_group() as services:
                self._services = services
                async with anyio.create_task_group() as relays:
                    self._relays = relays
                    await self.refresh()
                    services.start_soon(self._poller, name="fleet-poller")
                    self.started.set()
                    await self.fleet._stop_requested.wait()
                    self.stop_members()
                # Every relay has exited: nothing is in flight any more.
                services.cancel_scope.cancel()
        finally:
            self.started.set()
            with anyio.CancelScope(shield=True):
                if self._pulse is not None:
                    await self._pulse.stop()
                await settle_pool(self._pool)
                with anyio.move_on_after(s.db_command_timeout):
                    await self._pool.close()
                self._pool.terminate()

    async def _connect(self) -> None:
        self._pool, self._behind_pooler = await connect_worker_pool(
            self.settings, worker_app(self.fleet.relay_id)
        )

    # --- listening ----------------------------------------------------------------------------

    async def _listener_for(self, channel: str) -> Listener | None:
        """The listener of ``channel``, started (and listening) on first use."""
        if self.settings.poll_only:
            return None
        listener = self._listeners.get(channel)
        if listener is not None:
            await self._listening[channel].wait()
            return listener
        assert self._services is not None
        events = RelayEvents()
        heard = self._listening[channel] = anyio.Event()
        events.add_hook(lambda name, _n: heard.set() if name == "listening" else None)
        listener = Listener(
            self.settings.model_copy(update={"channel": channel}),
            lambda source: self._ring_channel(channel, source),
            events,
            notify=self._notify,
            route=lambda payload: self._route(channel, payload),
        )
        self._listeners[channel] = listener
        self._services.start_soon(listener.run, name=f"listener-{channel}")
        await heard.wait()
        return listener

    async def _notify(self, channel: str, payload: str) -> None:
        assert self._pool is not None
        await self._pool.execute("SELECT pg_notify($1, $2)", channel, payload)

    def _ring_channel(self, channel: str, source: str) -> None:
        """``start``/``reconnect`` of a channel's listener: every outbox of it claims (a
        backlog may have built up while nobody listened)."""
        for member in self.members.values():
            if member.names.channel == channel:
                member.relay.wake(source)
                self.activity.note(member, time.monotonic())

    def _route(self, channel: str, payload: str) -> None:
        if payload == REGISTRY_PAYLOAD:
            self._refresh_asked.set()
            return
        if not payload:
            # A trigger older than migration 0008: which outbox is not said.
            self._ring_channel(channel, "notification")
            return
        member = self.members.get(payload)
        if member is not None:
            member.relay.wake("notification")
            self.activity.note(member, time.monotonic())
        elif (
            self.spec.discover
            and payload not in self._ignored
            and time.monotonic() - self._unknown_at > _UNKNOWN_EVERY
        ):
            # A new tenant's first commit can come before the next look at the catalog.
            self._unknown_at = time.monotonic()
            self._refresh_asked.set()

    def _after_reap(self, claims: int) -> None:
        """The pulse ended a frozen relay's claims (of any outbox): their rows are free."""
        self.fleet.events.emit("reaped", claims)
        for member in self.members.values():
            member.relay.wake("retry")

    # --- the registry -------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Serve the outboxes wanted now: start relays for new ones, stop those gone."""
        async with self._refresh_lock:
            try:
                wanted = await self._wanted()
            except DATABASE_ERRORS as e:
                log.warning("looking for outboxes failed: %s", redact(str(e), self.settings))
                return
            for target, member in list(self.members.items()):
                if target not in wanted:
                    log.info("outbox %s is gone: stopping its relay", target)
                    member.relay.request_stop()
            for target, names in wanted.items():
                if target not in self.members:
                    await self._start(names)

    async def _wanted(self) -> dict[str, OutboxNames]:
        if not self.spec.discover:
            return {n.target: n for n in self.spec.outboxes}
        assert self._pool is not None
        async with self._pool.acquire() as conn:
            every = await discover_outboxes(conn, table=self.spec.table)
            found = every
            if self.spec.schemas_like is not None:
                allowed = set(await schemas_like(conn, self.spec.schemas_like))
                found = [f for f in every if f.names.schema in allowed]
            self._fingerprint = await conn.fetchval(f"SELECT {_FINGERPRINT}")
        wanted = {f.names.target: f.names for f in found}
        self._ignored = {f.names.target for f in every} - wanted.keys()
        return wanted

    async def _start(self, names: OutboxNames) -> None:
        assert self._pool is not None
        assert self._relays is not None
        publisher = self.fleet._publisher
        assert publisher is not None
        listener = await self._listener_for(names.channel)
        settings = self.fleet._member_settings(self.settings, names)
        shared = SharedPorts(
            pool=self._pool,
            behind_pooler=self._behind_pooler,
            publisher=publisher,
            listener=listener,
            pulse=self._pulse,
            relay_id=self.fleet.relay_id,
            kafka_outage=self.fleet.kafka_outage,
        )
        relay = Relay(settings, shared=shared, fault_hook=self.fleet._fault_hook)
        relay.events.add_hook(self.fleet.events.emit)
        member = _Member(relay, names)
        shared.pace = self.fleet._pacer(member, self.activity)
        shared.limit = self.fleet._limiter(member, self.activity)
        self.members[names.target] = member
        self._failed.pop(names.target, None)
        self._relays.start_soon(self._serve, member, name=f"relay-{names.target}")
        self.fleet._member_changed(self, names.target, relay)
        self.fleet.events.emit("outbox_started")

    async def _serve(self, member: _Member) -> None:
        target = member.names.target
        try:
            await member.relay.run()
        except Exception as e:  # one outbox's failure is that outbox's: the others go on
            reason = redact(str(e) or type(e).__name__, self.settings)
            self._failed[target] = reason
            self._ignored.add(target)  # tried again at the next discovery, not at its events
            log.error("outbox %s: its relay stopped: %s", target, reason)
        finally:
            if self.members.get(target) is member:
                del self.members[target]
                self.fleet._member_changed(self, target, None)
            member.done.set()
            self.fleet.events.emit("outbox_stopped")

    # --- the fallback poll --------------------------------------------------------------------

    def _statements(self, targets: tuple[str, ...]) -> list[str]:
        """The poll's statements for ``targets``: each returns the indexes (into targets) of
        the outboxes with unpublished rows, in chunks of ``_POLL_CHUNK``."""
        cached = self._poll_sql.get(targets)
        if cached is not None:
            return cached
        out = []
        for start in range(0, len(targets), _POLL_CHUNK):
            parts = []
            for i, target in enumerate(targets[start : start + _POLL_CHUNK], start):
                table = self.members[target].names.qualified_table
                # Both partial indexes of unpublished rows (fresh; waiting for a retry).
                parts.append(
                    f"CASE WHEN EXISTS (SELECT FROM {table} WHERE published_at IS NULL "
                    "AND next_attempt_at IS NULL) OR EXISTS (SELECT FROM "
                    f"{table} WHERE published_at IS NULL AND next_attempt_at IS NOT NULL) "
                    f"THEN {i} END"
                )
            out.append(f"SELECT array_remove(ARRAY[{', '.join(parts)}]::integer[], NULL)")
        self._poll_sql = {targets: out}  # the previous registry's are of no more use
        return out

    async def _poller(self) -> None:
        s = self.settings
        every = max(1, round(self.fleet._discovery_interval / s.poll_interval))
        polls = 0
        while True:
            with anyio.move_on_after(s.poll_interval):
                await self._refresh_asked.wait()
            if self._refresh_asked.is_set():
                self._refresh_asked = anyio.Event()
                await self.refresh()
                continue
            polls += 1
            await self.poll(catalog=self.spec.discover and polls % every == 0)

    async def poll(self, *, catalog: bool = False) -> None:
        """One fallback poll of every outbox (``catalog``: with the fingerprint of the
        database's outboxes, re-discovered when it changed)."""
        assert self._pool is not None
        targets = tuple(sorted(self.members))
        self.fleet.events.emit("fleet_poll")
        due: list[str] = []
        fingerprint: str | None = None
        try:
            statements = self._statements(targets) if targets else []
            if catalog:
                if statements:
                    first = statements[0].replace(
                        "SELECT array_remove(", f"SELECT {_FINGERPRINT}, array_remove(", 1
                    )
                    statements = [first, *statements[1:]]
                else:
                    statements = [f"SELECT {_FINGERPRINT}"]
            for n, sql in enumerate(statements):
                row = await self._pool.fetchrow(sql, timeout=self.settings.db_command_timeout)
                assert row is not None
                if catalog and n == 0:
                    fingerprint = row[0]
                    found = row[1] if targets else []
                else:
                    found = row[0]
                due.extend(targets[i] for i in found)
        except asyncpg.UndefinedTableError:
            # An outbox was dropped since the statement was made: look again now.
            self._refresh_asked.set()
            return
        except DATABASE_ERRORS as e:
            reason = redact(str(e) or type(e).__name__, self.settings)
            if self._poll_failing is None:
                log.warning("the fallback poll failed: %s", reason)
            self._poll_failing = reason
            return
        self._poll_failing = None
        for target in due:
            member = self.members.get(target)
            if member is not None:
                self.activity.note(member, time.monotonic())
                await member.relay.poll_once()
        if fingerprint is not None and (fingerprint != self._fingerprint or self._failed):
            await self.refresh()  # new or dropped outboxes; or try the failed ones again
