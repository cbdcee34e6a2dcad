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
from collections.abc import Callable
from typing import Any

import anyio
import asyncpg

from .backoff import Backoff
from .db import DATABASE_ERRORS
from .events import RelayEvents
from .settings import OutboxSettings
from .sqlfiles import Queries

__all__ = ["PROBE_PREFIX", "Listener"]

log = logging.getLogger("notify_outbox.listener")

PROBE_PREFIX = "notify-outbox-probe:"


class ListenerLost(Exception):
    """The listening connection is gone or did not answer its health probe."""


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
    ) -> None:
        self._settings = settings
        self._wake = wake
        self._events = events
        self._connect = connect
        self._probes: dict[str, asyncio.Future[None]] = {}
        self._queries = Queries(settings.names)
        # One query at a time on the connection (asyncpg refuses overlapping ones).
        self._lock = asyncio.Lock()
        self.connection: asyncpg.Connection | None = None
        #: Whether this relay holds the gated notify's awake marker A (on this connection).
        self.marked = False
        self._identity: tuple[int, Any] | None = None  # (pid, backend_start) of the session
        self._backoff = Backoff(settings.reconnect_min_delay, settings.reconnect_max_delay)
        self._lost_at: float | None = None  # when the last working session was lost

    def _on_notification(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        if payload.startswith(PROBE_PREFIX):
            # Our own health probe (or another relay's): proves the LISTEN, wakes nobody.
            waiter = self._probes.get(payload)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            return
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
            if self._identity is not None:
                # A dropped client socket does not end the server session at once; until it
                # ends, it may still hold the awake marker and producers may skip their
                # NOTIFY. End it (only that exact session) before the catch-up claim below.
                pid, started = self._identity
                await conn.execute(self._queries["end_old_listener"], pid, started, 5000)
            identity = await conn.fetchrow(self._queries["listener_identity"])
            self._identity = (identity["pid"], identity["backend_start"]) if identity else None
            # asyncpg runs LISTEN outside any transaction, so it is committed before the
            # catch-up claim that the wake below starts: nothing committed after this point
            # is missed.
            async with self._lock:
                await conn.add_listener(self._settings.channel, self._on_notification)
        # Only now may workers run gate statements on this connection.
        self.connection = conn
        # The session works: the next failure starts the backoff from the beginning.
        self._backoff.reset()
        if self._lost_at is not None:
            log.warning("listening again after %.1fs", time.monotonic() - self._lost_at)
            self._lost_at = None
        self._events.emit("listening")
        self._wake("start" if first else "reconnect")
        while True:
            with anyio.move_on_after(self._settings.listen_health_interval):
                await lost.wait()
            if lost.is_set():
                raise ListenerLost("the listening connection was closed")
            await self._probe(conn)

    async def _gate_query(self, name: str) -> bool | None:
        """Run one gate statement; the caller holds ``self._lock``. None if there is no
        healthy connection to run it on.

        Any failure terminates the connection: that releases A for certain, whereas a lock
        state we are unsure of could leave producers skipping their NOTIFY forever.
        """
        conn = self.connection
        if conn is None or conn.is_closed():
            self.marked = False
            return None
        try:
            with anyio.fail_after(self._settings.db_command_timeout):
                return bool(await conn.fetchval(self._queries[name]))
        except Exception as e:
            # asyncpg also raises protocol-state errors when the server ended the session
            # while it was idle: any failure means "this connection is done".
            log.warning("listening connection failed a gate statement (%s); closing it", e)
            self.marked = False
            conn.terminate()
            return None
        except BaseException:  # cancellation mid-statement
            self.marked = False
            conn.terminate()
            raise

    async def mark_awake(self) -> bool:
        """Take the awake marker A (never blocks); True if this relay now holds it."""
        # The check and the statement sit under one lock: advisory locks are re-entrant, and
        # taking A twice would leave it held after the one release of the sleep protocol.
        async with self._lock:
            if self.marked:
                return True
            self.marked = bool(await self._gate_query("mark_awake"))
        if self.marked:
            self._events.emit("gate_awake")
        return self.marked

    async def try_sleep(self) -> bool:
        """Release A if no producer is in flight. True: A is released (or was never held, or
        its connection is gone, which released it). False: producers are in flight that may
        have skipped their NOTIFY; stay awake and claim again."""
        async with self._lock:
            if not self.marked:
                return True
            released = await self._gate_query("try_sleep")
            if released is False:
                return False
            self.marked = False
        self._events.emit("gate_sleep")
        return True

    async def release(self) -> None:
        """Let producers NOTIFY again now, whether or not producers are in flight (see the
        ``release_awake`` query: the caller must then wait for ``gate_free``)."""
        async with self._lock:
            if not self.marked:
                return
            await self._gate_query("release_awake")
            self.marked = False
        self._events.emit("gate_sleep")

    async def gate_free(self) -> bool | None:
        """True when no producer is in flight; None without a healthy connection."""
        async with self._lock:
            return await self._gate_query("gate_free")

    async def run(self) -> None:
        """Listen until cancelled, reconnecting with exponential backoff and jitter.

        The log says when a working session is lost and when listening works again; failed
        attempts in between are quiet (DEBUG)."""
        s = self._settings
        first = True
        while True:
            conn: asyncpg.Connection | None = None
            try:
                with anyio.fail_after(s.db_command_timeout):
                    conn = await self._connect(
                        s.dsn.get_secret_value(),
                        server_settings={"application_name": "notify-outbox-listener"},
                    )
                await self._serve(conn, first)
            except _SESSION_ENDED as e:
                reason = type(e).__name__ if not isinstance(e, ListenerLost) else str(e)
                self._events.emit("listener_lost")
                # A lost session, or a connection that failed after it was made, is worth a
                # line each; a server that refuses connections only once per outage.
                if conn is not None or (first and self._backoff.failures == 0):
                    self._lost_at = self._lost_at or time.monotonic()
                    log.warning("listener connection lost (%s); reconnecting", reason)
                else:
                    log.debug("listener reconnect failed (%s)", reason)
            finally:
                self.connection = None
                self.marked = False  # a session-level lock dies with its session
                if conn is not None:
                    conn.terminate()
            first = False
            await self._backoff.sleep()
