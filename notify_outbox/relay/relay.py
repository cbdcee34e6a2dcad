"""The relay: one task group owning the listener, the fallback poller, housekeeping and the
workers that claim, publish and mark.

Embedded use::

    async with Relay(settings) as relay:
        ...  # the relay runs in the background of your event loop

``async with`` returns once the relay is ready, so it waits as long as PostgreSQL or Kafka
does not answer (see ``Relay.__aenter__``). An application whose own start must not wait::

    relay = Relay(settings)
    relay.start_background()  # returns at once; connects and retries in the background
    ...                       # relay.ready, await relay.wait_ready()
    await relay.stop()

or ``await Relay(settings).run()`` until ``request_stop()`` (graceful) or cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import asyncpg

from notify_outbox.core.backoff import Backoff
from notify_outbox.core.errors import (
    ClaimLost,
    ConfigurationError,
    NotifyOutboxError,
    PublisherUnavailable,
)
from notify_outbox.core.events import RelayEvents
from notify_outbox.core.logs import redact
from notify_outbox.core.settings import OutboxSettings
from notify_outbox.kafka.publisher import KafkaPublisher, Publisher, PublishResult, TokenProvider
from notify_outbox.pg.db import DATABASE_ERRORS, UNREACHABLE_ERRORS, read_only, settle_pool
from notify_outbox.pg.deadletters import report_expired
from notify_outbox.pg.store import (
    BatchOutcome,
    ClaimedBatch,
    LowWaterMark,
    OutboxRow,
    OutboxStore,
    PgOutboxStore,
    lost_after,
)

from .gate import Gate
from .keepalive import publish_renewing
from .listener import Listener
from .outage import Outage, tame_third_party_logs
from .policy import decide
from .pulse import Pulse
from .stagelog import open_stage_log
from .stalls import ClaimIdleTimeout
from .wakeup import Doorbell, RetryTimers
from .wiring import SharedPorts, connect_pool, kafka_publisher, open_postgres

__all__ = ["Relay"]

log = logging.getLogger("notify_outbox.relay")

# A failing statement (permissions, a broken schema) is not an outage: it is retried far less
# often than an unreachable server.
_STATEMENT_RETRY_CAP = 30.0
# The relay looks at most this many rows to say how many are pending (bounded work).
_COUNT_LIMIT = 100_000
# Points where a test can stop the process dead (see NOTIFY_OUTBOX_TEST_CRASH_AT in the CLI).
FaultHook = Callable[[str], None]
# Why a worker claims (stage log only, stagelog.py): the wake source or the reason it claimed
# again, when the notification behind it arrived (or None), and when the worker went.
_Cause = tuple[str, int | None, int]


def _configuration_error(error: BaseException) -> ConfigurationError | None:
    """The ConfigurationError in ``error``, however deep in exception groups."""
    if isinstance(error, ConfigurationError):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            if (found := _configuration_error(inner)) is not None:
                return found
    return None


def _jitter() -> float:
    """A retry's delay factor: spread retries of rows that failed together."""
    return random.uniform(0.5, 1.0)


def _log_end(task: asyncio.Task[None]) -> None:
    """Say at once why a relay started in the background ended, when it failed (nobody may
    be awaiting it until the application stops)."""
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        log.error("the relay stopped: %s", error, exc_info=error)


class Relay:
    """Moves committed outbox rows to Kafka: at least once, per-key in commit order.

    ``store`` and ``publisher`` are the two ports; leave them out to use PostgreSQL (through
    ``settings.dsn``) and Kafka (through ``settings.kafka_bootstrap_servers``). The relay
    closes what it built itself; ports given to it are the caller's to close.
    ``kafka_token_provider``: with SASL OAUTHBEARER, a function that returns a token (or an
    awaitable of one), called at each authentication; instead of the
    ``kafka_sasl_oauth_token_provider`` setting. ``shared``: the ports of a database whose
    outboxes one process serves (``Fleet``, ``fleet.py``); the relay then runs no listener,
    poller or pulse of its own, and closes none of them.
    """

    def __init__(
        self,
        settings: OutboxSettings,
        *,
        store: OutboxStore | None = None,
        publisher: Publisher | None = None,
        fault_hook: FaultHook | None = None,
        kafka_token_provider: TokenProvider | None = None,
        shared: SharedPorts | None = None,
    ) -> None:
        self.settings = settings
        self._shared = shared
        if shared is not None:
            publisher = shared.publisher
        self._kafka_token_provider = kafka_token_provider
        self.events = RelayEvents()
        self.outcome: Literal["running", "stopped", "forced", "aborted", "failed"] = "running"
        self._store = store
        self._publisher = publisher
        self._fault_hook = fault_hook
        self._doorbell = Doorbell()
        self._stopping = False
        self._stop_requested = anyio.Event()
        self._abort_scope = anyio.CancelScope()
        # Cancelled by abort(): a second signal cuts a graceful close (producer flush, pool
        # close) short instead of waiting for what is left of shutdown_timeout.
        self._close_scope = anyio.CancelScope()
        self._ready = anyio.Event()
        self._task: asyncio.Task[None] | None = None
        self._pool: asyncpg.Pool | None = None
        # The adapters this relay built (wiring.py), which it closes at the end; ports it
        # was given are their owner's to close.
        self._own_store: PgOutboxStore | None = None
        self._own_kafka: KafkaPublisher | None = None
        self.listener: Listener | None = None
        #: The gated notify's relay side (enabled by the database's notify_mode).
        self.gate = Gate(
            settings, self.events, look=self._due, wake=self._wake, stopping=lambda: self._stopping
        )
        self._busy_workers = 0
        #: When the first claim with rows of the current unbroken run of claims (some worker
        #: busy all along) ended: the gate's awake mark counts from there.
        self._busy_since: float | None = None
        self.kafka_outage = Outage("Kafka", log) if shared is None else shared.kafka_outage
        self.db_outage = Outage("PostgreSQL", log)
        self._retry_timers = RetryTimers(lambda: self._wake("retry"))
        self._busy_timer: asyncio.TimerHandle | None = None
        #: How long a claim may sit idle before PostgreSQL ends it (stalls.py).
        self.claim_timeout = ClaimIdleTimeout(settings.claim_idle_timeout)
        self._stop_deadline: float | None = None
        self._close_forced = False  # a graceful close had to abandon the producer or pool
        #: Whether NOTIFY_OUTBOX_DSN goes through a connection pooler (found at start).
        self.behind_pooler = False
        #: Names this relay's sessions in pg_stat_activity (pulse.py).
        self.relay_id = secrets.token_hex(4) if shared is None else shared.relay_id
        #: Proof that this process runs, and the end of frozen relays' claims (pulse.py);
        #: None when off (frozen_relay_timeout 0, a pooler, a store other than PostgreSQL's).
        self.pulse: Pulse | None = None
        #: Per-claim stage times for the bench (NOTIFY_OUTBOX_STAGE_LOG), else None.
        self._stages = open_stage_log()
        self._last_wake: tuple[str, int] | None = None  # (source, ns), kept for the stage log

    @property
    def low_water_mark(self) -> LowWaterMark:
        """Where this relay's claims start (migration 0006); the start of the table until the
        first claim (or with a store other than PostgreSQL's)."""
        store = self._own_store
        return store.marks.mark if store is not None else LowWaterMark()

    @property
    def busy_workers(self) -> int:
        """How many workers are claiming now (0: the relay is idle, waiting for a wake-up)."""
        return self._busy_workers

    def state_gauges(self) -> dict[str, float]:
        """This relay's own gauges for ``RelayMetrics`` (``ops/metrics.py``: STATE_GAUGES)."""
        return {
            "awake": float(self.gate.awake),
            "claim_idle_timeout_seconds": self.claim_timeout.current(),
        }

    def readiness_checks(self) -> dict[str, str]:
        """Checks of ``/readyz`` beyond the dependencies: none for this relay."""
        return {}

    # --- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Start the relay as a task of the running loop and return once it is ready.

        Ready means connected to PostgreSQL and Kafka, the workers running and (unless
        poll-only) the first LISTEN up. Until then it retries, without a time limit: while
        PostgreSQL is unreachable (``reconnect_min_delay`` to ``reconnect_max_delay``
        apart), and while Kafka does not answer (each attempt bounded by
        ``kafka_send_timeout``; a warning at the first failure and at one in 64 after it).
        So an application that enters it in its start-up waits as long as Kafka is down:
        use ``start_background()`` instead when its start must not wait.

        Raises at once what no retry cures: ``MigrationError`` (the outbox is missing or
        older than this relay) and ``ConfigurationError`` (a wrong password, a missing
        database). When the wait is cancelled (``asyncio.timeout`` around it, a shutdown),
        the relay is stopped before the cancellation goes on: nothing keeps running.
        """
        task = self._start_task()
        try:
            await self._until_ready_or_ended(task)
        except BaseException:
            await self._stop_unready()
            raise
        if not self._ready.is_set():
            task.result()  # raises the start-up error (a stop asked meanwhile: none)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def start_background(self) -> None:
        """Start the relay as a task of the running loop and return at once.

        For an application whose own start must not wait for Kafka or PostgreSQL (a web
        app's lifespan or ``on_startup``): the relay connects, and retries while they do not
        answer, in the background. ``ready`` says whether it delivers now, ``wait_ready()``
        waits until it does, and ``stop()`` (graceful) or ``abort()`` ends it, also while it
        is still connecting. An error that ends the run (``MigrationError``,
        ``ConfigurationError``, a crash) is logged at once, raised by ``wait_ready()`` and
        by ``stop()``, and leaves ``ready`` False with ``outcome`` ``"failed"``.
        """
        self._start_task().add_done_callback(_log_end)

    def _start_task(self) -> asyncio.Task[None]:
        if self._task is not None:
            raise RuntimeError("this relay was started already: a Relay runs once")
        self._task = asyncio.create_task(self.run(), name="notify-outbox-relay")
        return self._task

    async def _stop_unready(self) -> None:
        """Stop a relay whose start was abandoned, and wait until it has exited (its own
        error, if it failed, is the caller's to raise)."""
        task = self._task
        assert task is not None
        self.request_stop()
        with contextlib.suppress(BaseException):
            await asyncio.shield(task)

    @property
    def ready(self) -> bool:
        """Whether the relay delivers now: started (what ``wait_ready`` waits for), not
        stopping or stopped, and no PostgreSQL or Kafka outage known. For an application's
        readiness probe; ``RelayMetrics.readiness()`` tells why not, per dependency."""
        return (
            self._ready.is_set()
            and not self._stopping
            and self.outcome == "running"
            and not self.kafka_outage.active
            and not self.db_outage.active
        )

    async def wait_ready(self) -> None:
        """Wait until the workers run (and, unless poll-only, the first LISTEN is up).

        For a relay started with ``start_background()`` or ``async with``: raises the error
        that ended its run before it got ready (``MigrationError``, ``ConfigurationError``),
        or ``NotifyOutboxError`` when it was stopped before it got ready. Waits without a
        time limit: put ``asyncio.timeout()`` around it for one.
        """
        task = self._task
        if task is None:
            await self._ready.wait()
            return
        await self._until_ready_or_ended(task)
        if self._ready.is_set():
            return
        task.result()  # raises the error that ended the run
        raise NotifyOutboxError(f"the relay stopped before it was ready ({self.outcome})")

    async def _until_ready_or_ended(self, task: asyncio.Task[None]) -> None:
        ready = asyncio.ensure_future(self._ready.wait())
        try:
            await asyncio.wait([ready, task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()

    def request_stop(self) -> None:
        """Stop claiming; in-flight batches finish (up to ``shutdown_timeout``), then exit.
        Safe to call from a signal handler running in the loop, and more than once."""
        if self._stopping:
            return
        log.log(
            logging.INFO if self._shared is None else logging.DEBUG,  # a fleet says it once
            "stopping: finishing in-flight batches (up to %ss)",
            self.settings.shutdown_timeout,
        )
        # One deadline for the whole graceful stop: batches in flight, then the producer's
        # flush and the pool's close share it (each used to get a full shutdown_timeout).
        self._stop_deadline = time.monotonic() + self.settings.shutdown_timeout
        self._stopping = True
        self._doorbell.close()
        self._stop_requested.set()

    def abort(self) -> None:
        """Stop now: in-flight claims roll back, their rows stay pending (and may be sent
        again later: at-least-once)."""
        log.warning("aborting: in-flight batches are rolled back")
        self._stopping = True
        self._doorbell.close()
        self._stop_requested.set()
        if self.outcome == "running":
            self.outcome = "aborted"
        self._abort_scope.cancel()
        self._close_scope.cancel()

    async def stop(self) -> None:
        """Graceful stop of a relay started with ``async with`` or ``start_background()``
        (also while it is still connecting); returns when it has exited, and raises the
        error that ended its run, if one did."""
        self.request_stop()
        if self._task is not None:
            await self._task

    # --- the run ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until ``request_stop()``/``abort()`` or cancellation.

        Raises MigrationError when the outbox table does not exist, and re-raises unexpected
        errors of any worker after stopping the others (never runs half-alive).
        """
        try:
            with self._abort_scope, tame_third_party_logs():
                await self._run()
        except BaseException as e:
            if self.outcome == "running":
                self.outcome = "failed"
            # A setting that cannot work (found by the listener, inside the task groups)
            # surfaces as itself, not wrapped in exception groups.
            wrong = _configuration_error(e)
            if wrong is not None and wrong is not e:
                raise wrong from None
            raise
        if self.outcome == "running":
            self.outcome = "forced" if self._close_forced else "stopped"

    async def _run(self) -> None:
        clean = False
        try:
            if not await self._open():
                clean = True
                return
            shared = self._shared
            async with anyio.create_task_group() as services:
                if shared is not None:
                    # The fleet's listener (listening already), poller, pulse, Kafka watch
                    # and outage reminders serve this outbox with the others of its database.
                    self.listener = self.gate.listener = shared.listener
                elif not self.settings.poll_only:
                    self.listener = Listener(
                        self.settings, self._wake, self.events, notify=self._notify
                    )
                    self.gate.listener = self.listener
                    services.start_soon(self.listener.run, name="listener")
                if shared is None:
                    services.start_soon(self._poller, name="poller")
                    services.start_soon(self._remind_outages, name="outage-reminders")
                    services.start_soon(self._watch_kafka, name="kafka-watch")
                services.start_soon(self.gate.renew_while_claiming, name="gate-renewer")
                services.start_soon(self._housekeeping, name="housekeeping")
                services.start_soon(self._shutdown_watchdog, name="watchdog")
                services.start_soon(self.claim_timeout.watch_loop, name="stall-watch")
                async with anyio.create_task_group() as workers:
                    for n in range(self.settings.workers):
                        workers.start_soon(self._worker, name=f"worker-{n}")
                    if self.settings.poll_only or shared is not None:
                        self._wake("start")
                    else:
                        await self.events.wait_for("listening")
                    self._ready.set()
                # Every worker has exited: nothing is in flight any more.
                services.cancel_scope.cancel()
            clean = not self._abort_scope.cancel_called
        finally:
            self._retry_timers.cancel()
            if self._busy_timer is not None:
                self._busy_timer.cancel()
            self.gate.close()
            if self._stages is not None:
                self._stages.close()
            # Cancelled, aborted or failed: tear down at once (rows in flight stay pending).
            with anyio.CancelScope(shield=True):
                await self._close(graceful=clean)

    async def _open(self) -> bool:
        """Connect the ports not given (``wiring.py``), retrying until PostgreSQL and Kafka
        answer or a stop is asked."""
        s = self.settings
        shared = self._shared
        if self._store is None:
            if shared is not None:
                pool, self.behind_pooler = shared.pool, shared.behind_pooler
            else:
                connected = await self._until_stopped(connect_pool(s, self.relay_id))
                if connected is None:
                    return False
                self._pool, self.behind_pooler = connected
                pool = self._pool
            pg = await open_postgres(
                pool,
                self.behind_pooler,
                s,
                self.relay_id,
                begin_round_trip=self.claim_timeout.round_trip,
                on_reaped=self._after_reap,
                shared=shared is not None,
            )
            self._store = self._own_store = pg.store
            self.gate.enabled = (
                pg.notify_mode == "gated"
                and not s.poll_only
                and (shared is None or shared.listener is not None)
            )
            self.gate.epoch_ms = pg.awake_epoch_ms
            if shared is not None:
                self.pulse = shared.pulse
                if self.pulse is not None:
                    pg.store.reaped_after = s.frozen_relay_timeout
            else:
                self.pulse = pg.pulse
                if self.pulse is not None:
                    self.pulse.start()
        if self._publisher is None:
            kafka = kafka_publisher(s, self._kafka_token_provider)
            self._publisher = self._own_kafka = kafka
            # A first start fails on settings Kafka refuses (credentials, TLS): exit, and
            # say why, rather than retry forever.
            await self._until_stopped(kafka.start(fatal=True))
        return not self._stopping

    def _after_reap(self, claims: int) -> None:
        """The pulse ended ``claims`` claims of a frozen relay: their rows are free now."""
        self.events.emit("reaped", claims)
        self._wake("retry")

    async def _notify(self, channel: str, payload: str) -> None:
        """NOTIFY over the store's connections (the listener's check that LISTEN works)."""
        assert self._store is not None
        await self._store.notify(channel, payload)

    def _shutdown_left(self) -> float:
        """Seconds left of the graceful stop's deadline (all of it if no stop was asked)."""
        if self._stop_deadline is None:
            return self.settings.shutdown_timeout
        return max(0.0, self._stop_deadline - time.monotonic())

    async def _close(self, *, graceful: bool) -> None:
        if self.pulse is not None and self._shared is None:
            await self.pulse.stop()
        if self._own_store is not None:
            # Connections waiting for a next claim go back to the pool, which waits for them.
            with anyio.move_on_after(self.settings.db_command_timeout, shield=True):
                await self._own_store.close()
        if self._pool is not None:
            await settle_pool(self._pool)  # cancelled statements: their cancel requests first
        # Runs shielded from the run's cancellation; only abort() cancels _close_scope.
        with self._close_scope:
            if self._own_kafka is not None:
                stopped = await self._own_kafka.stop(self._shutdown_left() if graceful else 1.0)
                # Every batch was marked only after its acks, so nothing is lost; still, the
                # stop did not finish within shutdown_timeout, and the exit status says so.
                self._close_forced = self._close_forced or (graceful and not stopped)
            if self._pool is not None and graceful:
                # Every worker has finished: the pool's connections are idle. Close them
                # politely within what is left of shutdown_timeout, else at once.
                left = min(self.settings.db_command_timeout, self._shutdown_left())
                with anyio.move_on_after(left) as scope:
                    await self._pool.close()
                    self._pool = None
                if scope.cancelled_caught:
                    self._close_forced = True
        if graceful and self._close_scope.cancelled_caught:
            log.warning("aborted the graceful stop: Kafka producer and connections dropped")
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None

    async def _until_stopped(self, coro: Any) -> Any:
        """Run ``coro`` until it returns or a stop is requested (then return None)."""
        result: Any = None
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await self._stop_requested.wait()
                tg.cancel_scope.cancel()

            async def work() -> None:
                nonlocal result
                result = await coro
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            tg.start_soon(work)
        return result

    async def _shutdown_watchdog(self) -> None:
        await self._stop_requested.wait()
        await anyio.sleep(self.settings.shutdown_timeout)
        log.error(
            "in-flight batches did not finish within shutdown_timeout=%ss; aborting",
            self.settings.shutdown_timeout,
        )
        self.outcome = "forced"
        self._abort_scope.cancel()

    # --- wake-ups -----------------------------------------------------------------------------

    def wake(self, source: str = "notification") -> None:
        """Ring the relay: a worker claims (``start`` and ``reconnect``: every worker). For
        whoever listens on its behalf (``fleet.py``); the relay's own listener calls it too."""
        self._wake(source)

    def _wake(self, source: str) -> None:
        self.events.emit(f"wake:{source}")
        if self._stages is not None:
            self._last_wake = (source, time.monotonic_ns())
        if source in ("start", "reconnect"):
            # A backlog may have built up while nobody listened: let every worker at it.
            self._doorbell.ring_all()
        else:
            self._doorbell.ring()

    def _wake_for_retry(self, delay: float, rows: Iterable[int] | None = None) -> None:
        """Wake a worker when a row's retry becomes due (otherwise only the fallback poll
        would notice); ``rows``: the rows due then (``wakeup.RetryTimers``)."""
        if not self._stopping:
            self._retry_timers.after(delay, rows)

    def _wake_after_busy(self, delay: float) -> None:
        """Wake a worker ``delay`` seconds after the latest claim that met buckets held by
        other claims (by then a frozen holder's claim has ended). One timer, moved later by
        each such claim: a timer per claim (one per 50 ms grid slot) kept waking workers
        20 times a second under a steady load, where the holders are this relay's own
        busy workers, and each wake added a claim that met them again."""
        if self._stopping:
            return
        if self._busy_timer is not None:
            self._busy_timer.cancel()
        self._busy_timer = asyncio.get_running_loop().call_later(delay, self._wake, "retry")

    async def _poller(self) -> None:
        while True:
            await anyio.sleep(self.settings.poll_interval)
            await self.poll_once()

    async def poll_once(self) -> None:
        """The fallback poll's look: wake a worker when rows are due, and arm the timer of
        the earliest retry. (A relay of a fleet is polled by the fleet, which asks only the
        outboxes that have unpublished rows.)"""
        if self._store is None:
            return  # not connected yet: its start claims anyway
        self.events.emit("poll")
        try:
            due, retry_in = await self._store.poll()
        except DATABASE_ERRORS as e:
            # The safety net failing is worth a line (once per outage).
            self.db_outage.failed(redact(str(e) or type(e).__name__, self.settings))
            return
        if retry_in is not None and not self._retry_timers.near(retry_in):
            self._wake_for_retry(retry_in)  # e.g. retries scheduled by a relay that died
        if due:
            self._wake("poll")

    async def _watch_kafka(self) -> None:
        """While no worker is busy, ask Kafka now and then whether it still answers: an
        outage is then logged (and seen by /readyz) when it starts, not at the next event,
        and the next event waits for Kafka instead of being claimed into a failing send."""
        assert self._publisher is not None
        while True:
            await anyio.sleep(self.settings.kafka_idle_check_interval)
            if self._busy_workers or (self._publisher.available and await self._publisher.check()):
                continue
            self.events.emit("kafka_unavailable")
            self.kafka_outage.failed("Kafka stopped answering")
            await self._wait_for_kafka()

    async def _remind_outages(self) -> None:
        while True:
            await anyio.sleep(1.0)
            self.kafka_outage.remind()
            self.db_outage.remind()

    async def _housekeeping(self) -> None:
        s = self.settings
        assert self._store is not None
        if s.delete_on_publish and s.dead_letter_retention is None:
            return
        while True:
            await anyio.sleep(s.cleanup_interval)
            try:
                while not s.delete_on_publish and (
                    n := await self._store.delete_expired(s.keep_published, s.cleanup_batch)
                ):
                    self.events.emit("cleanup", n)
                    if n < s.cleanup_batch:
                        break
                if (retention := s.dead_letter_retention) is not None:
                    n = await self._store.expire_dead_letters(retention, s.cleanup_batch)
                    report_expired(n, retention, self.events)
            except DATABASE_ERRORS as e:
                log.warning("retention cleanup failed: %s", redact(str(e), s))

    # --- workers ------------------------------------------------------------------------------

    async def _worker(self) -> None:
        s = self.settings
        # Each worker backs off on its own: N failing workers must not double one delay N
        # times. Unreachable servers are retried quickly (capped at reconnect_max_delay).
        backoffs = (
            Backoff(s.reconnect_min_delay, s.reconnect_max_delay),
            Backoff(s.reconnect_min_delay, _STATEMENT_RETRY_CAP),
        )
        while await self._doorbell.wait():
            self._busy_workers += 1
            try:
                await self._drain(backoffs, self._woken())
            finally:
                self._busy_workers -= 1
                if not self._busy_workers:
                    self._busy_since = None
            self.events.emit("idle")

    def _woken(self, why: str | None = None) -> _Cause | None:
        """The stage log's cause of the next claim (None when there is no stage log): the
        latest wake-up since the previous claim, or ``why`` the worker claims again."""
        if self._stages is None:
            return None
        now = time.monotonic_ns()
        wake, self._last_wake = self._last_wake, None
        if why is not None or wake is None:
            return (why or "again", None, now)
        source, at = wake
        return (source, at if source == "notification" else None, now)

    async def _drain(self, backoffs: tuple[Backoff, Backoff], cause: _Cause | None) -> None:
        """Claim batches until nothing is due (a wake-up drains the table).

        With the gated notify (``gate.py``), unbroken draining at ``gate_awake_rate`` rows
        per second or more marks the relay awake, and
        the last busy worker runs the gate's sleep protocol before it idles. Unbroken for
        the relay, not for one worker: under a steady load its notified workers take turns,
        each claim a few rows, and none of them drains for long on its own, while the relay
        has had a worker claiming all along (at 800 ev/s a relay went on being woken by a
        NOTIFY per commit for 20-60 s after its start, at twice the latency).
        """
        pace = None if self._shared is None else self._shared.pace
        limit_now = None if self._shared is None else self._shared.limit
        limit = self.settings.batch_size
        while not self._stopping:
            began = 0.0
            if pace is not None:
                began = time.monotonic()
            if limit_now is not None:
                limit = limit_now() or self.settings.batch_size
            done = await self._claim_once(backoffs, cause, limit)
            if done is None:
                cause = self._woken("error")
                continue  # an error was handled (and waited out): claim again
            claimed, more = done
            if claimed:
                now = time.monotonic()  # not anyio.current_time(): its backend look-up, per claim
                if self._busy_since is None:
                    self._busy_since = now
                await self.gate.busy_for(now - self._busy_since, claimed)
                if claimed >= limit:
                    # More is probably waiting: bring an idle sibling in to help.
                    self._wake("backlog")
                    if pace is not None:
                        await pace(time.monotonic() - began)
                    cause = self._woken("full")
                    continue
                if more is not False:
                    cause = self._woken("more")
                    continue
            elif more:
                cause = self._woken("parked")
                continue  # the claim parked rows and got none: more may be parked
            if not await self.gate.settle(self._busy_workers):
                return
            cause = self._woken("gate")

    async def _due(self) -> bool:
        """Whether a claim would get something; True after an error, so that the caller
        claims (and the claim handles the error)."""
        assert self._store is not None
        try:
            return await self._store.has_due()
        except DATABASE_ERRORS:
            return True

    async def _claim_once(
        self, backoffs: tuple[Backoff, Backoff], cause: _Cause | None, limit: int
    ) -> tuple[int, bool | None] | None:
        """One claim-publish-mark round: rows claimed, and whether more rows were due after
        it committed (None: unknown). None after an error that was logged and waited out.
        ``backoffs``: this worker's for an unreachable server, and for a failing statement."""
        s = self.settings
        assert self._publisher is not None
        if not self._publisher.available:
            # Claim nothing while Kafka is away: rows stay pending, no transaction held.
            await self._wait_for_kafka()
            return None
        began = time.monotonic()
        try:
            claimed = await self._process_batch(cause, limit)
        except ClaimLost as e:
            # Not a database outage: the relay stalled. Claim again at once (a new session).
            self.events.emit("claim_lost")
            log.warning("%s", e)
            return None
        except PublisherUnavailable as e:
            self.events.emit("kafka_unavailable")
            self.kafka_outage.failed(str(e))
            await self._wait_for_kafka()
            return None
        except DATABASE_ERRORS as e:
            self.events.emit("db_error")
            reason = redact(str(e) or type(e).__name__, s)
            # A standby or a demoted primary: the store ended the session; reconnect as
            # quickly as to an unreachable server (a multi-host DSN finds the new primary).
            if ro := read_only(e):
                reason = f"read-only server, reconnecting: {reason}"
            self.db_outage.failed(reason)
            backoff = backoffs[0] if ro or isinstance(e, UNREACHABLE_ERRORS) else backoffs[1]
            if backoff is backoffs[1] and backoff.failures % 16 == 0:
                # Not an outage but a failing statement (permissions, a broken schema):
                # say what it is now and then, not at every retry.
                log.error("claim failed: %s", redact(str(e) or type(e).__name__, s))
            await self._until_stopped(backoff.sleep())
            return None
        for backoff in backoffs:
            backoff.reset()
        # Only a claim begun after the outage started proves it over: one begun before may
        # have run in a transaction primed before the server turned read-only, which still
        # writes (the store drops primed transactions at the first read-only error, but not
        # one a claim is already using).
        started = self.db_outage.started
        if started is not None and began > started:
            self.db_outage.recovered(await self._count_pending())
        return claimed

    async def _wait_for_kafka(self) -> None:
        """Wait until Kafka answers again (one prober for all workers), then log the end of
        the outage once."""
        assert self._publisher is not None
        # This relay claims nothing meanwhile: let producers wake the other relays.
        await self.gate.release()
        await self._until_stopped(self._publisher.wait_available())
        if self._publisher.available and self.kafka_outage.active:
            self.kafka_outage.recovered(await self._count_pending())
            self.events.emit("kafka_back")

    async def _count_pending(self) -> int | None:
        assert self._store is not None
        try:
            return await self._store.count_pending(_COUNT_LIMIT)
        except DATABASE_ERRORS:
            return None

    async def _process_batch(self, cause: _Cause | None, limit: int) -> tuple[int, bool | None]:
        pulse = self.pulse
        if pulse is None:
            return await self._claim_and_publish(cause, limit)
        # The pulse beats while a claim is open: another relay ends this one's claims only
        # when both went silent (pulse.py).
        pulse.claim_started()
        try:
            return await self._claim_and_publish(cause, limit)
        finally:
            pulse.claim_ended()

    async def _claim_and_publish(self, cause: _Cause | None, limit: int) -> tuple[int, bool | None]:
        assert self._store is not None
        assert self._publisher is not None
        self.gate.progress()
        # A worker holds its claim open while Kafka acknowledges, and says so every quarter
        # of this (_publish_kept_alive); if the relay stalls, the server ends that
        # transaction soon, and other relays may take its keys (stalls.py).
        idle_timeout = self.claim_timeout.for_claim()
        # Silent this long, the claim may be gone: ended by the server, or by another relay
        # while this process did not run (pulse.py).
        lost = lost_after(idle_timeout, None if self.pulse is None else self.pulse.timeout)
        start = time.monotonic_ns() if cause is not None else 0
        async with self._store.claim(limit, idle_timeout) as batch:
            self.gate.progress()
            rows_at = time.monotonic_ns() if cause is not None else 0
            rows = batch.rows
            if batch.busy:
                # Other claims held buckets with fresh rows. A live one goes on with them
                # itself. A frozen one's claim is ended by this relay's pulse, which then
                # wakes a worker; without a pulse, by PostgreSQL after its idle timeout, and
                # nothing would wake a relay then: look again once that has happened.
                # (Its timeout is its relay's; the fleet's relays usually learn alike.)
                if self.pulse is not None:
                    self.pulse.saw_busy()
                self._wake_after_busy(idle_timeout * 1.1)
            if not rows:
                self.events.emit("claimed_none")
                # Rows parked (a failing key's, a chunk per claim) are no sign of an idle
                # table: the next chunk waits for the next claim, now rather than at a poll.
                return 0, batch.parked
            self.events.emit("claimed", len(rows))
            if self._retry_timers.tracking:
                # Retries claimed before their own timer fired: that timer would wake a
                # worker into an empty claim.
                self._retry_timers.claimed(r.id for r in rows if r.attempts)
            log.debug("claimed %d rows", len(rows))
            self._fault("after_claim")
            if batch.idle() > lost / 2:
                # The relay did not run for a while since its claim (frozen, or its loop
                # starved): the claim may have been ended and another relay taken its rows.
                # Ask before sending them again behind that relay's copies.
                await batch.keepalive()
            result = await self._publish_kept_alive(batch, idle_timeout)
            acked = time.monotonic_ns() if cause is not None else 0
            self._fault("after_ack")
            outcome = decide(rows, result, self.settings, jitter=_jitter)
            _log_outcome(rows, outcome, self.settings)
            # The claim commits at once, even when Kafka became unavailable: its rows that
            # were not acknowledged stay pending, and no transaction waits for the broker.
            await batch.complete(outcome)
        self.gate.progress()
        if self._stages is not None and cause is not None:
            self._stages.claim(
                src=cause[0],
                notified=cause[1],
                woken=cause[2],
                start=start,
                rows_at=rows_at,
                handed=result.handed_at,
                acked=acked,
                marked=time.monotonic_ns(),
                rows=rows,
            )
        self._fault("after_mark")
        self.events.emit("published", len(outcome.published))
        if outcome.retry:
            self.events.emit("retried", len(outcome.retry))
            for row_id, _, delay in outcome.retry:
                self._wake_for_retry(delay, (row_id,))
        if outcome.dead:
            self.events.emit("dead_lettered", len(outcome.dead))
        self.events.report_batch(rows, outcome, result.unavailable)
        self.events.emit("batch_done")
        settled = len(outcome.published) + len(outcome.dead) + len(outcome.retry)
        if result.unavailable is not None:
            self.kafka_outage.failed(result.unavailable, result.dependency)
            self.kafka_outage.held += len(rows) - settled
            raise PublisherUnavailable(result.unavailable)
        # Rows left as they were (held back behind a failed row of their key) count for
        # nothing: a full claim of them is no sign of a backlog.
        return settled, batch.more_due

    async def _publish_kept_alive(self, batch: ClaimedBatch, idle_timeout: float) -> PublishResult:
        """Publish a claim's rows; while the acks take long, renew the claim's transaction
        (the server ends it after ``idle_timeout`` of silence, as for a stalled relay). The
        claim's connection is free meanwhile: the publisher never uses it."""
        publisher = self._publisher
        assert publisher is not None
        return await publish_renewing(
            lambda: publisher.publish(batch.rows), batch.keepalive, idle_timeout / 4
        )

    def _fault(self, point: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(point)


def _fields(row: OutboxRow, attempts: int, reason: str) -> dict[str, object]:
    """Structured fields of a row's log line (JSON logs: notify_outbox/logs.py)."""
    return {
        "row_id": row.id,
        "event_id": str(row.event_id),
        "topic": row.topic,
        "key": row.key,
        "attempts": attempts,
        "error": reason,
    }


def _log_outcome(
    rows: Sequence[OutboxRow], outcome: BatchOutcome, settings: OutboxSettings
) -> None:
    """Log each row that ``decide`` dead-lettered (ERROR) or scheduled for a retry
    (WARNING), with its structured fields."""
    if not outcome.dead and not outcome.retry:
        return
    by_id = {row.id: row for row in rows}
    for row_id, reason in outcome.dead:
        row = by_id[row_id]
        log.error(
            "dead-lettering row %s (topic %s): %s",
            row.id,
            row.topic,
            reason,
            extra=_fields(row, row.attempts + 1, reason),
        )
    for row_id, reason, delay in outcome.retry:
        row = by_id[row_id]
        attempts = row.attempts + 1
        log.warning(
            "row %s (topic %s) failed, attempt %d of %d, next in %.1fs: %s",
            row.id,
            row.topic,
            attempts,
            settings.max_attempts,
            delay,
            reason,
            extra={**_fields(row, attempts, reason), "retry_in_seconds": round(delay, 3)},
        )
