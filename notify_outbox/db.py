"""Connecting to PostgreSQL: the one list of database errors, and which of them will never
heal by retrying."""

from __future__ import annotations

import asyncpg

__all__ = ["DATABASE_ERRORS", "UNREACHABLE_ERRORS"]

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
