"""The listener: one dedicated connection that LISTENs on the outbox channel.

A notification is only a hint to claim (its payload is never trusted: any role can NOTIFY any
channel). The connection is never taken from a pool (a pool reset drops LISTEN) and never
opens a transaction (a listener stuck in a transaction would fill the server's notify queue).
Its health is proven actively: every ``listen_health_interval`` it NOTIFYs a token on its own
channel and must hear the echo within ``listen_health_timeout``; that catches a dead socket
that TCP alone would not report for many minutes.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import asyncpg

from notify_outbox.core.backoff import Backoff
from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.events import RelayEvents
from notify_outbox.core.settings import OutboxSettings
from notify_outbox.pg.db import DATABASE_ERRORS, read_only, session_parameters, terminate
from notify_outbox.pg.sqlfiles import Queries

__all__ = ["PROBE_PREFIX", "ListenUnsupported", "Listener"]

log = logging.getLogger("notify_outbox.listener")

PROBE_PREFIX = "notify-outbox-probe:"


class ListenerLost(Exception):
    """The listening connection is gone or did not answer its health probe."""


class ListenUnsupported(ConfigurationError):
    """LISTEN does not work through this connection (a transaction-pooling PgBouncer hands
    the server session to other clients between statements, notifications included)."""


# How long to wait between attempts once LISTEN was found not to work: it takes a change of
# the pooler's or the relay's settings to cure, not a quick retry.
_UNSUPPORTED_RETRY = 30.0


# What ends a listening session and starts the reconnect loop (anything else is a bug: raised).
_SESSION_ENDED: tuple[type[Exception], ...] = (*DATABASE_ERRORS, ListenerLost)


class Listener:
    """Keeps a LISTEN alive and calls ``wake(source)`` on every hint to claim."""

    def __init__(
        self,
        settings: OutboxSettings,
        wake: Callable[[str], None],
        events: RelayEvents,
        *,
        connect: Callable[..., Any] = asyncpg.connect,
        notify: Callable[[str, str], Awaitable[object]] | None = None,
        route: Callable[[str], None] | None = None,
    ) -> None:
        """``notify(channel, payload)`` sends a notification over another connection (the
        workers' pool): it proves that a LISTEN through a connection pooler hears
        notifications at all (see ``_check_listen``). ``route(payload)``: takes every
        notification that is not a health probe instead of ``wake`` (a relay serving many
        outboxes, ``fleet.py``, rings the outbox the payload names); ``wake`` still gets
        ``start`` and ``reconnect``."""
        self._settings = settings
        self._wake = wake
        self._route = route
        self._target = settings.names.target
        self._events = events
        self._connect = connect
        self._notify = notify
        self._probes: dict[str, asyncio.Future[None]] = {}
        self._queries = Queries(settings.names)
        # One query at a time on the connection (asyncpg refuses overlapping ones).
        self._lock = asyncio.Lock()
        self.connection: asyncpg.Connection | None = None
        # (pid, backend_start) of the last session, when it was a direct one (see _serve).
        self._identity: tuple[int, Any] | None = None
        #: Whether the current session is PostgreSQL's own (no pooler in between): only then
        #: is the awake marker, a session-level lock, tied to this relay's life.
        self.direct = True
        self._pooled_noted = False
        self._backoff = Backoff(settings.reconnect_min_delay, settings.reconnect_max_delay)
        self._lost_at: float | None = None  # when the last working session was lost
        self._read_only = False  # LISTEN was refused by a standby (and logged) since then
        # The gate's statements, prepared once per direct session (see _fetchval).
        self._prepared: dict[str, asyncpg.prepared_stmt.PreparedStatement] = {}
        self._prepared_on: asyncpg.Connection | None = None

    def _on_notification(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        if payload.startswith(PROBE_PREFIX):
            # Our own health probe (or another relay's): proves the LISTEN, wakes nobody.
            waiter = self._probes.get(payload)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            return
        if self._route is not None:
            self._route(payload)
        elif not payload or payload == self._target:
            # Since migration 0008 the payload names the outbox: another outbox's commits on
            # a shared channel wake nobody here (an empty one is an older trigger's, or a
            # hand-made NOTIFY: it wakes, as before).
            self._wake("notification")

    async def _probe(self, conn: asyncpg.Connection) -> None:
        token = PROBE_PREFIX + secrets.token_hex(8)
        echo: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._probes[token] = echo
        try:
            with anyio.fail_after(self._settings.listen_health_timeout):
                async with self._lock:
                    await conn.execute("SELECT pg_notify($1, $2)", self._settings.channel, token)
                await echo
        except TimeoutError:
            raise ListenerLost(
                f"no echo of the health probe within {self._settings.listen_health_timeout}s"
            ) from None
        finally:
            del self._probes[token]

    async def _serve(self, conn: asyncpg.Connection, first: bool) -> None:
        lost = anyio.Event()
        conn.add_termination_listener(lambda _c: lost.set())
        # The connection may die silently during its set-up too, before the health probe
        # runs: every statement here needs a deadline (TimeoutError means reconnect).
        with anyio.fail_after(self._settings.db_command_timeout):
            identity = await conn.fetchrow(self._queries["listener_identity"])
            # Behind a pooler the server pid differs from the one announced at start-up, and
            # the server session may serve another client tomorrow: never end it by pid.
            self.direct = identity is not None and identity["pid"] == conn.get_server_pid()
            if self.direct and self._identity is not None:
                # A dropped client socket does not end the server session at once; until it
                # ends, it may still hold the awake marker and producers may skip their
                # NOTIFY. End it (only that exact session: pid and start time, recorded on a
                # direct connection) before the catch-up claim below.
                pid, started = self._identity
                await conn.execute(self._queries["end_old_listener"], pid, started, 5000)
            self._identity = (identity["pid"], identity["backend_start"]) if self.direct else None
            # asyncpg runs LISTEN outside any transaction, so it is committed before the
            # catch-up claim that the wake below starts: nothing committed after this point
            # is missed.
            async with self._lock:
                await conn.add_listener(self._settings.channel, self._on_notification)
        if not self.direct:
            await self._check_listen()
        # Only now may workers run gate statements on this connection.
        self.connection = conn
        # The session works: the next failure starts the backoff from the beginning.
        self._backoff.reset()
        if self._lost_at is not None:
            log.warning("listening again after %.1fs", time.monotonic() - self._lost_at)
            self._lost_at = None
        self._read_only = False
        self._events.emit("listening")
        self._wake("start" if first else "reconnect")
        while True:
            with anyio.move_on_after(self._settings.listen_health_interval):
                await lost.wait()
            if lost.is_set():
                raise ListenerLost("the listening connection was closed")
            await self._probe(conn)

    async def _check_listen(self) -> None:
        """Behind a pooler: prove that this LISTEN hears a notification sent over another
        connection. A session pooler passes it; a transaction pooler cannot (between
        statements the server session, and its notifications, belong to nobody)."""
        if self._notify is None:
            return
        token = PROBE_PREFIX + secrets.token_hex(8)
        echo: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._probes[token] = echo
        try:
            with anyio.move_on_after(self._settings.listen_health_timeout):
                await self._notify(self._settings.channel, token)
                await echo
        finally:
            del self._probes[token]
        # (Cancelling the wait cancels the future too: only a result counts.)
        if echo.cancelled() or not echo.done():
            raise ListenUnsupported(
                "LISTEN does not work through the listening connection's DSN (a "
                "transaction-pooling PgBouncer?): set NOTIFY_OUTBOX_LISTEN_DSN to a DSN of "
                "PostgreSQL itself (or of a session-pooling pooler) for the one listening "
                "connection, or NOTIFY_OUTBOX_POLL_ONLY=true"
            )
        if not self._pooled_noted:
            self._pooled_noted = True
            log.info(
                "listening through a connection pooler (session pooling): the gated notify "
                "is off for this relay and producers always NOTIFY; point "
                "NOTIFY_OUTBOX_LISTEN_DSN at PostgreSQL itself to use it"
            )

    async def session_statement(
        self, sql: str, *args: object
    ) -> tuple[asyncpg.Connection, Any] | None:
        """Run one statement of the gated notify (``gate.py``) on the listening session: the
        connection it ran on and its result (first column), or None without a healthy
        connection.

        A failure terminates the connection: that releases the awake marker for certain,
        whereas a lock state we are unsure of could leave producers skipping their NOTIFY."""
        async with self._lock:
            conn = self.connection
            if conn is None or conn.is_closed():
                return None
            try:
                with anyio.fail_after(self._settings.db_command_timeout):
                    return conn, await self._fetchval(conn, sql, args)
            except DATABASE_ERRORS as e:
                log.warning("listening connection failed a gate statement (%s); closing it", e)
                await terminate(conn)
                return None
            except BaseException:  # cancellation mid-statement
                await terminate(conn)
                raise

    async def _fetchval(self, conn: asyncpg.Connection, sql: str, args: tuple[object, ...]) -> Any:
        if not self.direct:
            return await conn.fetchval(sql, *args)
        # An awake relay runs the gate's statements tens of times a second. The connection
        # has no statement cache (it is made before we know whether a pooler is in between),
        # and preparing each anew cost two round trips and a parse: 10% of a drain's relay
        # CPU in a py-spy profile. On PostgreSQL's own session a prepared statement lives as
        # long as the connection.
        if self._prepared_on is not conn:
            self._prepared = {}
            self._prepared_on = conn
        stmt = self._prepared.get(sql)
        if stmt is None:
            stmt = self._prepared[sql] = await conn.prepare(sql)
        return await stmt.fetchval(*args)

    async def run(self) -> None:
        """Listen until cancelled, reconnecting with exponential backoff and jitter.

        The log says when a working session is lost and when listening works again; failed
        attempts in between are quiet (DEBUG)."""
        s = self._settings
        dsn = (s.listen_dsn or s.dsn).get_secret_value()
        first = True
        while True:
            conn: asyncpg.Connection | None = None
            wait: float | None = None
            try:
                with anyio.fail_after(s.db_command_timeout):
                    # No statement cache: a pooler in between would break it, and whether
                    # there is one is known only once connected. The gate's statements,
                    # the only frequent ones, are prepared on a direct session (_fetchval).
                    conn = await self._connect(
                        dsn,
                        statement_cache_size=0,
                        server_settings=session_parameters("notify-outbox-listener"),
                    )
                await self._serve(conn, first)
            except ListenUnsupported as e:
                if first:
                    raise  # at start: refuse, with the fix, rather than run half-deaf
                # Found after a reconnect (the DSN now leads through another pooler): the
                # fallback poll keeps delivering meanwhile.
                self._events.emit("listener_lost")
                log.error("%s; the fallback poll delivers meanwhile", e)
                wait = _UNSUPPORTED_RETRY
            except _SESSION_ENDED as e:
                reason = type(e).__name__ if not isinstance(e, ListenerLost) else str(e)
                self._events.emit("listener_lost")
                # A lost session, or a connection that failed after it was made, is worth a
                # line each; a server that refuses connections only once per outage, and a
                # hot standby that refuses LISTEN once until listening works again.
                if read_only(e):
                    self._lost_at = self._lost_at or time.monotonic()
                    log.log(
                        logging.DEBUG if self._read_only else logging.WARNING,
                        "listener's server is a read-only standby (%s); reconnecting",
                        e,
                    )
                    self._read_only = True
                elif conn is not None or (first and self._backoff.failures == 0):
                    self._lost_at = self._lost_at or time.monotonic()
                    log.warning("listener connection lost (%s); reconnecting", reason)
                else:
                    log.debug("listener reconnect failed (%s)", reason)
            finally:
                self.connection = None  # a session-level lock (the awake marker) dies with it
                if conn is not None:
                    await terminate(conn)
            first = False
            if wait is not None:
                await anyio.sleep(wait)
            else:
                await self._backoff.sleep()
