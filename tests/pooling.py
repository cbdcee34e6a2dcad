"""PgBouncer instances in front of the tests' PostgreSQL (the ``poolers`` fixture)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from devstack._common import tail
from devstack.pgbouncer import POOL_MODES, PgBouncer, PoolMode


@dataclass
class Poolers:
    """One PgBouncer per pool mode, both pooling the tests' PostgreSQL."""

    transaction: PgBouncer
    session: PgBouncer

    def pooler(self, mode: str) -> PgBouncer:
        """The pooler of ``mode`` ("transaction" or "session")."""
        if mode == "transaction":
            return self.transaction
        if mode == "session":
            return self.session
        raise ValueError(f"pool mode must be one of {POOL_MODES}, not {mode!r}")

    def dsn_through(self, mode: str, dsn: str) -> str:
        """Rewrite a direct DSN (database, user, options kept) to go through a pooler.

        A role the pooler does not know yet, given with its password, is added
        to its auth_file first, so ``dsn_with_user(db_dsn, ...)`` works too.
        """
        pooler = self.pooler(mode)
        parts = urlsplit(dsn)
        user = unquote(parts.username) if parts.username else pooler.admin_user
        if user not in pooler.users:
            if parts.password is None:
                raise ValueError(
                    f"role {user!r} is unknown to the pooler and the DSN has no password for it"
                )
            pooler.add_user(user, unquote(parts.password))
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"127.0.0.1:{pooler.port}"
        return urlunsplit(parts._replace(netloc=f"{userinfo}@{netloc}" if userinfo else netloc))

    def restart_crashed(self) -> list[str]:
        """Restart any pooler that died on its own; describe each crash (with its log tail).

        PgBouncer 1.18 (Debian bookworm's) can exit with a FATAL error, e.g. when a
        client drops a cancel request's connection early (pgbouncer issue #801, fixed
        in 1.19.1). The test during which that happened should fail, and the next ones
        should find a pooler again instead of "connection refused".
        """
        crashes: list[str] = []
        for pooler in (self.transaction, self.session):
            if pooler.is_running:
                continue
            crashes.append(
                f"PgBouncer ({pooler.pool_mode} pooling, port {pooler.port}) exited during "
                f"this test; last lines of {pooler.log_path}:\n{tail(pooler.log_path, 8)}"
            )
            pooler.start()
        return crashes

    def stop(self) -> None:
        """Stop both; the second is stopped even if the first fails."""
        with contextlib.ExitStack() as stack:
            for pooler in (self.transaction, self.session):
                stack.callback(pooler.stop)


def start_poolers(direct_dsn: str, base_dir: Path) -> Poolers:
    """Start a transaction-mode and a session-mode PgBouncer in front of ``direct_dsn``.

    Its user (with its password, if any) is the one the poolers log in with
    and the admin of their consoles.
    """
    parts = urlsplit(direct_dsn)
    if not parts.hostname:
        raise ValueError("the tests' DSN has no host; a pooler needs host and port")
    user = unquote(parts.username) if parts.username else "postgres"
    password = unquote(parts.password) if parts.password is not None else None
    started: list[PgBouncer] = []
    modes: tuple[PoolMode, ...] = ("transaction", "session")
    try:
        for mode in modes:
            pooler = PgBouncer(
                base_dir / mode,
                postgres_host=parts.hostname,
                postgres_port=parts.port or 5432,
                pool_mode=mode,
                users={user: password},
            )
            pooler.start()
            started.append(pooler)
    except BaseException:
        for pooler in started:
            with contextlib.suppress(Exception):
                pooler.stop()
        raise
    return Poolers(transaction=started[0], session=started[1])
