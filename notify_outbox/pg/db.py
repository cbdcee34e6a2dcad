"""Connecting to PostgreSQL: the one list of database errors, which of them no retry cures,
whether a pooler sits in between, and ending a connection without upsetting one."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from urllib.parse import parse_qs, unquote, urlsplit

import anyio
import asyncpg

from notify_outbox.core.backoff import Backoff
from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.logs import redact
from notify_outbox.core.settings import OutboxSettings

__all__ = [
    "DATABASE_ERRORS",
    "UNREACHABLE_ERRORS",
    "behind_pooler",
    "connect_worker_pool",
    "dsn_address",
    "never_heals",
    "read_only",
    "require_supported_server",
    "session_parameters",
    "settle_pool",
    "statement_cache_size",
    "terminate",
]

log = logging.getLogger("notify_outbox.relay")

# Everything a database call can raise when the database, not the relay, is the problem.
# InternalClientError: asyncpg's protocol state after the server vanished mid-operation
# ("cannot switch to state ...; another operation is in progress"); a database error like the
# others, not a reason to bring the whole relay down.
DATABASE_ERRORS: tuple[type[Exception], ...] = (
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    TimeoutError,
)

# The subset that means "the server is not there (yet)": cheap to retry, and retried quickly so
# that delivery resumes within about a second of PostgreSQL coming back.
UNREACHABLE_ERRORS: tuple[type[Exception], ...] = (
    OSError,
    asyncpg.CannotConnectNowError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    TimeoutError,
)


# SQLSTATEs of connection errors that no retry will cure: say what to fix instead of waiting.
_NEVER_HEALS = {
    "28000": "the server refused this user or client address (pg_hba.conf, or the pooler's "
    "auth settings)",
    "28P01": "the password was refused",
    "3D000": "the database does not exist",
    "42501": "the user may not connect to this database",
}
# PgBouncer reports its own refusals, and the server's refusals it passes on, as protocol
# violations (08P01), among transient ones such as "pgbouncer cannot connect to server"; these
# are the permanent ones.
_POOLER_REFUSALS = (
    "unsupported startup parameter",
    "no such database",
    "no such user",
    "does not exist",
    "password authentication failed",
    "no pg_hba.conf entry",
)


def never_heals(error: BaseException) -> str | None:
    """Why retrying to connect cannot help (a wrong password, a missing database, a pooler
    that refuses a start-up parameter), or None for errors that may pass (an outage)."""
    if isinstance(error, asyncpg.ClientConfigurationError):
        return "the connection settings are invalid"
    if isinstance(error, ssl.SSLCertVerificationError):
        # sslmode=verify-ca or verify-full: a server that shows this certificate now will
        # show it at the next attempt too.
        if error.verify_code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_
            return (
                "TLS hostname check failed: the server's certificate does not name the host "
                f"connected to ({error.verify_message})"
            )
        return (
            "TLS certificate verification failed: the server's certificate is not trusted "
            f"by the CA in sslrootcert ({error.verify_message})"
        )
    code = getattr(error, "sqlstate", None)
    if code in _NEVER_HEALS:
        return _NEVER_HEALS[code]
    if code == "08P01" and any(r in str(error) for r in _POOLER_REFUSALS):
        return "the connection pooler refused the connection"
    return None


# "cannot execute INSERT in a read-only transaction", "cannot execute LISTEN during recovery":
# the texts of 25006, for an error that reaches us without its SQLSTATE (a proxy, a wrapper).
_READ_ONLY_TEXTS = ("in a read-only transaction", "during recovery")


def read_only(error: BaseException) -> bool:
    """Whether ``error`` says the server takes no writes on this session (SQLSTATE 25006): a
    hot standby, a demoted primary, or ``default_transaction_read_only``. Retrying on the same
    session is useless; a new connection may reach the writable server (a multi-host DSN with
    ``target_session_attrs=read-write``), or the same one once it is writable again."""
    if getattr(error, "sqlstate", None) == "25006":
        return True
    return isinstance(error, asyncpg.PostgresError) and any(
        text in str(error) for text in _READ_ONLY_TEXTS
    )


def dsn_address(dsn: str) -> str:
    """Where ``dsn`` points, as ``host:port`` (comma-separated when it lists several hosts),
    for messages: never its user or password. A host or port the URL leaves out is taken from
    its ``host=`` / ``port=`` parameters, then ``PGHOST`` / ``PGPORT``, as libpq and asyncpg
    do, else ``localhost:5432``."""
    rest = dsn.split("://", 1)[-1]
    # The host list ends at the path or the query; a password holds no "/" or "?" (the DSN
    # check refuses them unencoded), so the last "@" before that ends the user information.
    netloc = rest.split("/", 1)[0].split("?", 1)[0].rpartition("@")[2]
    try:
        params = parse_qs(urlsplit(dsn).query)
    except ValueError:
        params = {}
    hosts = netloc or params.get("host", [""])[0] or os.environ.get("PGHOST", "")
    default_port = params.get("port", [""])[0] or os.environ.get("PGPORT", "") or "5432"
    found = []
    for item in hosts.split(","):
        if item.startswith("["):  # an IPv6 address: [::1]:5432
            host, _, port = item.partition("]")
            host, port = host + "]", port.removeprefix(":")
        elif item.startswith("/"):  # a Unix socket's directory
            host, port = item, ""
        else:
            host, _, port = item.partition(":")
        found.append(f"{unquote(host) or 'localhost'}:{port or default_port}")
    return ",".join(found)


async def behind_pooler(conn: asyncpg.Connection) -> bool:
    """Whether a connection pooler (PgBouncer) sits between this client and PostgreSQL.

    A pooler answers the start-up itself, with a backend key (pid) of its own making; the pid
    of the server process that actually runs our statements differs from it. A plain TCP
    proxy passes the server's key through, and keeps the session: it counts as direct."""
    server_pid: int = await conn.fetchval("SELECT pg_backend_pid()")
    announced: int = conn.get_server_pid()
    return announced != server_pid


def statement_cache_size(configured: int | None, pooled: bool) -> int:
    """asyncpg's statement cache size: the setting, else none behind a pooler (a named
    prepared statement lives in one server session, which a transaction pooler hands to
    other clients between transactions), else asyncpg's default."""
    if configured is not None:
        return configured
    return 0 if pooled else 100


# How long ending a connection waits for asyncpg's cancel requests still on their way.
_CANCEL_GRACE = 1.0


async def terminate(conn: asyncpg.Connection) -> None:
    """End ``conn`` at once, but only after asyncpg's cancel requests still on their way (a
    statement that timed out or was cancelled) have been delivered, for up to a second.

    ``Connection.terminate()`` and ``close()`` alone abandon them mid-flight, and PgBouncer
    before 1.19.1 (Debian 12 ships 1.18) crashes, disconnecting every client it serves, when a
    cancel request's connection closes before it forwarded the request (pgbouncer issue #801).
    Shielded from cancellation: it runs on error and cancellation paths."""
    await _cancel_requests_sent([conn])
    conn.terminate()


async def settle_pool(pool: asyncpg.Pool) -> None:
    """Before a pool is closed or terminated: let its connections' cancel requests go out
    (see ``terminate``). A statement cancelled with its task (a relay that stops, or aborts)
    leaves one in flight."""
    # asyncpg keeps a pool's connections in its holders; no public accessor exists.
    holders = getattr(pool, "_holders", ())
    await _cancel_requests_sent([c for h in holders if (c := getattr(h, "_con", None))])


async def _cancel_requests_sent(conns: list[asyncpg.Connection]) -> None:
    # asyncpg tracks its in-flight cancel requests per connection in _cancellations.
    pending = [t for c in conns for t in getattr(c, "_cancellations", ()) if not t.done()]
    if pending:
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CANCEL_GRACE):
            await asyncio.wait(pending)


#: The oldest PostgreSQL major the relay runs on: the listener ends its stale session with
#: pg_terminate_backend(pid, timeout), which PostgreSQL 14 introduced.
MIN_SERVER_VERSION = 140000


async def require_supported_server(conn: asyncpg.Connection) -> None:
    """Raise ConfigurationError on a PostgreSQL older than 14, before anything fails later
    in a less obvious way."""
    version = int(await conn.fetchval("SELECT current_setting('server_version_num')"))
    if version < MIN_SERVER_VERSION:
        raise ConfigurationError(
            f"PostgreSQL {version // 10000} is not supported: notify-outbox needs PostgreSQL 14 "
            "or newer"
        )


def session_parameters(application_name: str) -> dict[str, str]:
    """Start-up parameters for every connection the relay opens.

    Only parameters PgBouncer tracks itself pass a pooler. ``client_encoding`` is spelled as
    the server reports it: asyncpg sends ``'utf-8'``, which PgBouncer (1.18 at least) takes for
    a different value than the server's ``UTF8`` and re-sends as a ``SET`` before every
    transaction, one more statement and round trip each (measured: 2x the statements of an
    idle poll-only relay). Sent after asyncpg's own, it wins; PostgreSQL itself takes it too.
    """
    return {"application_name": application_name, "client_encoding": "UTF8"}


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """Pool release hook that skips asyncpg's reset query (``pg_advisory_unlock_all(); CLOSE
    ALL; UNLISTEN *; RESET ALL``): four statements and a round trip on every release, which
    made four of an idle fallback poll's five statements. Worker connections never LISTEN,
    SET, open cursors or take session advisory locks (the awake marker lives on the
    listener's own connection), and asyncpg still rolls back a transaction left open."""


async def connect_worker_pool(
    settings: OutboxSettings, application_name: str = "notify-outbox-worker"
) -> tuple[asyncpg.Pool, bool]:
    """The relay workers' pool, and whether a pooler sits in between. Retries while
    PostgreSQL is unreachable; raises ConfigurationError at once for what no retry cures (a
    wrong password, a missing database, a pooler that refuses the connection)."""
    s = settings
    dsn = s.dsn.get_secret_value()
    backoff = Backoff(s.reconnect_min_delay, s.reconnect_max_delay)
    while True:
        try:
            with anyio.fail_after(s.db_command_timeout):
                # One throwaway connection first, without a statement cache, finds out
                # whether a pooler sits in between; the pool's settings depend on it.
                probe = await asyncpg.connect(
                    dsn,
                    statement_cache_size=0,
                    server_settings=session_parameters(application_name),
                )
                try:
                    await require_supported_server(probe)
                    pooled = await behind_pooler(probe)
                finally:
                    await probe.close()
                # No session settings: a pooler rejects start-up parameters it does not
                # know, and would not keep them for us anyway (the claim sets what it
                # needs with SET LOCAL). application_name passes PgBouncer.
                pool: asyncpg.Pool = await asyncpg.create_pool(
                    dsn,
                    min_size=1,
                    max_size=s.workers + 2,
                    command_timeout=s.db_command_timeout,
                    statement_cache_size=statement_cache_size(s.statement_cache_size, pooled),
                    server_settings=session_parameters(application_name),
                    reset=_keep_session,
                )
            if pooled:
                log.info(
                    "NOTIFY_OUTBOX_DSN goes through a connection pooler: no prepared-"
                    "statement cache, no session state on worker connections"
                )
            return pool, pooled
        except DATABASE_ERRORS as e:
            message = redact(str(e) or type(e).__name__, s)
            if (why := never_heals(e)) is not None:
                raise ConfigurationError(
                    f"cannot connect to PostgreSQL with NOTIFY_OUTBOX_DSN: {why} ({message})"
                ) from None
            delay = backoff.next_delay()
            # The first failure and one in 64 as warnings; every attempt at DEBUG.
            log.log(
                logging.WARNING if backoff.failures % 64 == 1 else logging.DEBUG,
                "PostgreSQL not reachable (%s); retrying every %.1fs or so",
                message,
                backoff.cap,
            )
            await anyio.sleep(delay)
