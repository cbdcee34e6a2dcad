"""The consumer side: an idempotent consumer ("inbox") for events the relay delivered.

The relay delivers at least once, so a consumer sees repeats after crashes, restarts and
rebalances. The inbox makes applying them exactly-once *in the consumer's own database*: each
event id is recorded in a processed-events table in the same transaction as the consumer's
business change, so a repeat finds its id and is skipped, and a failure rolls both back::

    inbox = Inbox(consumer="billing")

    async with conn.transaction():
        async with inbox.process(conn, message) as fresh:
            if fresh:
                await conn.execute("INSERT INTO invoices ...")
    await kafka_consumer.commit()  # offsets move only after the database commit

or let ``consume`` run that loop (manual offset commits after each database commit, optional
Redis fast path). The table comes from its own migration track: ``notify-outbox migrate
--inbox`` (or ``migrate_inbox``), printed by ``notify-outbox sql --inbox``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, Protocol

import anyio
import asyncpg
from aiokafka import TopicPartition
from aiokafka import errors as kafka_errors

from .errors import ConfigurationError, MigrationError, NotifyOutboxError
from .migrations import MigrationTrack, VerifyReport, migrate_track, render_track, verify_track
from .names import validate_identifier
from .sqlfiles import render_queries

if TYPE_CHECKING:
    import redis.asyncio
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

__all__ = [
    "INBOX_TRACK",
    "OUTBOX_EVENT_ID_HEADER",
    "BadEventId",
    "Inbox",
    "InboxError",
    "InboxMessage",
    "InboxNames",
    "InboxNotMigrated",
    "NotInTransaction",
    "RedisSeen",
    "consume",
    "migrate_inbox",
    "purge_inbox",
    "render_inbox_migrations",
    "verify_inbox",
]

log = logging.getLogger("notify_outbox.inbox")

# The header the relay puts on every record (publisher.to_message): the outbox row's event_id.
OUTBOX_EVENT_ID_HEADER = "outbox-event-id"
# Canonical text form of a UUID, as the relay writes it; any case is accepted and lowered.
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)
# The table's CHECK constraint: a btree entry must stay well under PostgreSQL's ~2.7 kB limit.
MAX_ID_BYTES = 512


# --- errors -----------------------------------------------------------------------------------


class InboxError(NotifyOutboxError):
    """Base class of the inbox's errors."""


class BadEventId(InboxError, ValueError):
    """A message has no event id, or one that is malformed (see ``Inbox(on_bad_id=...)``)."""


class NotInTransaction(InboxError):
    """``Inbox.process`` was called outside a transaction, where it could not protect anything."""


class InboxNotMigrated(InboxError, MigrationError):
    """The inbox table does not exist in the consumer's database."""


# --- names and migrations ---------------------------------------------------------------------


@dataclass(frozen=True)
class InboxNames:
    """The validated names of one inbox table (in the consumer's database)."""

    schema: str = "public"
    table: str = "inbox"

    def __post_init__(self) -> None:
        validate_identifier(self.schema, "inbox schema")
        # Derived names (the primary key, the index) append suffixes.
        validate_identifier(self.table, "inbox table", max_length=40)

    @property
    def qualified_table(self) -> str:
        """The table, schema-qualified and quoted."""
        return f'"{self.schema}"."{self.table}"'

    @property
    def target(self) -> str:
        """The inbox track's key in the tracking table, distinct from any outbox's."""
        return f"inbox:{self.schema}.{self.table}"

    @property
    def lock_namespace(self) -> int:
        """The bigint advisory key of ``migrate --inbox``: a stable signed 32-bit number."""
        n = zlib.crc32(f"notify_outbox:{self.target}".encode())
        return n - (1 << 32) if n >= (1 << 31) else n

    def substitutions(self) -> dict[str, str]:
        """Tokens of ``sql/inbox/`` and ``sql/inbox_queries.sql`` mapped to their text."""
        s = f'"{self.schema}"'
        return {
            "@schema@": s,
            "@table@": self.qualified_table,
            "@prefix@": self.table,
            # The same tracking table as the outbox's: rows are keyed by ``target``.
            "@migrations@": f'{s}."notify_outbox_migrations"',
        }


INBOX_TRACK = MigrationTrack[InboxNames](
    folder="inbox",
    command="notify-outbox migrate --inbox",
    relations=lambda t: [t],
    in_schema=lambda names, schema: InboxNames(schema, names.table),
)


async def migrate_inbox(conn: asyncpg.Connection, names: InboxNames | None = None) -> list[int]:
    """Create or upgrade the inbox table in the consumer's database; returns the versions
    applied. Safe to run concurrently (like ``migrate``)."""
    return await migrate_track(conn, INBOX_TRACK, names or InboxNames())


async def verify_inbox(conn: asyncpg.Connection, names: InboxNames | None = None) -> VerifyReport:
    """Compare the inbox table with the shipped inbox migrations (like ``verify``)."""
    return await verify_track(conn, INBOX_TRACK, names or InboxNames())


def render_inbox_migrations(names: InboxNames | None = None, *, since: int = 0) -> str:
    """The inbox migrations after ``since`` as one SQL script, for psql, Alembic or Flyway."""
    return render_track(INBOX_TRACK, names or InboxNames(), since=since)


async def purge_inbox(
    conn: asyncpg.Connection,
    older_than: timedelta,
    *,
    names: InboxNames | None = None,
    consumer: str | None = None,
    batch: int = 5000,
) -> int:
    """Delete ids processed more than ``older_than`` ago (of one consumer, or of all); returns
    how many. Runs in batches of short statements; do not call it inside a transaction.

    The trade-off: a message redelivered after its id was purged is applied *again*. Keep ids
    longer than the longest time a message can be redelivered: the topic's retention, or how
    long a consumer group may lag or be reset to an old offset.
    """
    if older_than <= timedelta(0):
        raise ConfigurationError("older_than must be a positive duration")
    if batch < 1:
        raise ConfigurationError("batch must be at least 1")
    sql = _queries(names or InboxNames())["purge"]
    total = 0
    while True:
        try:
            status = await conn.execute(sql, older_than, consumer, batch)
        except asyncpg.UndefinedTableError:
            raise _not_migrated(names or InboxNames()) from None
        deleted = int(status.split()[-1])
        total += deleted
        if deleted < batch:
            return total


_QUERIES: dict[InboxNames, dict[str, str]] = {}


def _queries(names: InboxNames) -> dict[str, str]:
    if names not in _QUERIES:
        _QUERIES[names] = render_queries("inbox_queries.sql", names)
    return _QUERIES[names]


def _not_migrated(names: InboxNames) -> InboxNotMigrated:
    return InboxNotMigrated(
        f"the inbox table {names.schema}.{names.table} does not exist in this database: run "
        f"`notify-outbox migrate --inbox --schema {names.schema} --table {names.table}` "
        "(or notify_outbox.inbox.migrate_inbox) against the consumer's database"
    )


# --- the inbox --------------------------------------------------------------------------------


class InboxMessage(Protocol):
    """What the inbox reads from a message: aiokafka's ``ConsumerRecord`` has this shape."""

    @property
    def headers(self) -> Sequence[tuple[str, bytes]]:
        """The record's headers."""
        ...

    @property
    def key(self) -> bytes | None:
        """The record's key."""
        ...


IdSource = Literal["header", "key"]
IdFormat = Literal["uuid", "text"]
BadIdPolicy = Literal["raise", "skip", "apply"]


def _describe(message: InboxMessage) -> str:
    where = [
        f"{attr} {getattr(message, attr)}"
        for attr in ("topic", "partition", "offset")
        if getattr(message, attr, None) is not None
    ]
    return f"message ({', '.join(where)})" if where else "message"


class Inbox:
    """An idempotent consumer: applies each event once in the consumer's database.

    Settings:

    - ``consumer``: a name for this consumer. Several consumers (handlers, consumer groups)
      can share one table; each applies every event once.
    - ``id_source``: ``"header"`` (default) reads the id from the header ``id_header``
      (default ``outbox-event-id``, set by the relay); ``"key"`` uses the message key, for
      messages from producers whose key is a unique message id.
    - ``id_format``: ``"uuid"`` (default; the relay's ids) accepts only a UUID in the usual
      8-4-4-4-12 hex form, any case, stored lower-case so one id has one spelling;
      ``"text"`` accepts any UTF-8 text of 1 to 512 bytes, as is.
    - ``on_bad_id``: what a message without an id, or with a malformed one, does.
      ``"raise"`` (default) raises ``BadEventId``: the consumer stops at that message until
      someone looks (its offset is never committed, so nothing is lost). ``"skip"``
      never applies it; ``"apply"`` applies it every time it is delivered, without
      deduplication. Both log a WARNING per message and count it in ``counts``
      (``bad_id_skipped`` / ``bad_id_applied``), so neither is silent.
    - ``fast_path``: an optional ``RedisSeen``, used by ``apply`` and ``consume``.

    ``counts`` holds counters: ``fresh`` and ``duplicate`` (what ``process`` found),
    ``applied`` (committed by ``apply``), ``duplicate_fast`` (skipped on Redis's word),
    ``bad_id_skipped``, ``bad_id_applied``.
    """

    def __init__(
        self,
        *,
        consumer: str = "default",
        names: InboxNames | None = None,
        id_source: IdSource = "header",
        id_header: str = OUTBOX_EVENT_ID_HEADER,
        id_format: IdFormat = "uuid",
        on_bad_id: BadIdPolicy = "raise",
        fast_path: RedisSeen | None = None,
    ) -> None:
        if not isinstance(consumer, str) or not consumer:
            raise ConfigurationError("consumer must be a non-empty string")
        if id_source not in ("header", "key"):
            raise ConfigurationError(f"id_source must be 'header' or 'key', not {id_source!r}")
        if id_format not in ("uuid", "text"):
            raise ConfigurationError(f"id_format must be 'uuid' or 'text', not {id_format!r}")
        if on_bad_id not in ("raise", "skip", "apply"):
            raise ConfigurationError(
                f"on_bad_id must be 'raise', 'skip' or 'apply', not {on_bad_id!r}"
            )
        if id_source == "header" and not id_header:
            raise ConfigurationError("id_header must be a header name")
        self.consumer = consumer
        self.names = names or InboxNames()
        self.id_source = id_source
        self.id_header = id_header
        self.id_format = id_format
        self.on_bad_id = on_bad_id
        self.fast_path = fast_path
        self.counts: Counter[str] = Counter()

    @cached_property
    def _claim_sql(self) -> str:
        return _queries(self.names)["claim"]

    def event_id(self, message: InboxMessage) -> str:
        """The message's event id as stored in the inbox; raises ``BadEventId`` when it is
        missing or malformed (whatever ``on_bad_id`` says: the policy applies in ``process``)."""
        if self.id_source == "key":
            raw: bytes | None = message.key
            what = "key"
            if raw is None:
                raise BadEventId(f"{_describe(message)} has no key, which this inbox uses as id")
        else:
            what = f"header {self.id_header!r}"
            values = {v for k, v in (message.headers or ()) if k == self.id_header}
            if not values:
                raise BadEventId(
                    f"{_describe(message)} has no {what}: not an outbox event? (set "
                    "Inbox(id_header=...) or id_source='key' for other producers, or "
                    "on_bad_id='skip'/'apply')"
                )
            if len(values) > 1:
                raise BadEventId(f"{_describe(message)} has {len(values)} different {what} values")
            (raw,) = values
        if not isinstance(raw, bytes | bytearray):
            raise BadEventId(f"{_describe(message)}: {what} is not bytes")
        try:
            text = bytes(raw).decode()
        except UnicodeDecodeError:
            raise BadEventId(f"{_describe(message)}: {what} is not UTF-8") from None
        if self.id_format == "uuid":
            if not _UUID.fullmatch(text):
                raise BadEventId(
                    f"{_describe(message)}: {what} is not a UUID (got {text[:60]!r}); use "
                    "Inbox(id_format='text') for ids that are not UUIDs"
                )
            return text.lower()
        if not text or len(raw) > MAX_ID_BYTES:
            raise BadEventId(
                f"{_describe(message)}: {what} must be 1 to {MAX_ID_BYTES} bytes (got {len(raw)})"
            )
        return text

    def _bad_id(self, error: BadEventId) -> bool:
        """Apply the ``on_bad_id`` policy; returns whether to apply the message."""
        if self.on_bad_id == "raise":
            raise error
        apply = self.on_bad_id == "apply"
        self.counts["bad_id_applied" if apply else "bad_id_skipped"] += 1
        log.warning(
            "%s (on_bad_id=%r: %s)",
            error,
            self.on_bad_id,
            "applied without deduplication" if apply else "skipped, not applied",
        )
        return apply

    @contextlib.asynccontextmanager
    async def process(
        self, conn: asyncpg.Connection | AsyncSession | AsyncConnection, message: InboxMessage
    ) -> AsyncIterator[bool]:
        """Record the message's event id in the caller's transaction; yields ``fresh``.

        ``conn`` is an asyncpg connection (or a pool's), or a SQLAlchemy ``AsyncSession`` or
        ``AsyncConnection`` (inside ``async with session.begin():``).

        ``fresh`` is True when this event was not processed before: apply it inside the block,
        on the same connection and transaction. It is False for a repeat: do nothing. The id
        and the business change commit together or roll back together; an exception in the
        block propagates, so the caller's transaction rolls both back.

        Concurrent consumers (a rebalance handing a partition over while its old owner is still
        applying a message): the second transaction's insert of the same id waits on the
        table's unique index until the first commits (then it sees the id: ``fresh`` is False)
        or rolls back (then it inserts the id: ``fresh`` is True). So two consumers can never
        both apply one event, whatever their timing. (Under REPEATABLE READ or SERIALIZABLE
        the second transaction fails with a serialization error instead; its retry skips.)

        Raises ``NotInTransaction`` outside a transaction, ``InboxNotMigrated`` when the table
        is missing, and ``BadEventId`` per ``on_bad_id``.
        """
        raw: Any = conn
        asyncpg_like = hasattr(raw, "fetchval")  # a connection, or a pool's proxy of one
        if not (raw.is_in_transaction() if asyncpg_like else conn.in_transaction()):
            raise NotInTransaction(
                "Inbox.process must run inside the transaction of the business change "
                "(async with conn.transaction(): async with inbox.process(conn, msg) ...); "
                "otherwise the id and the change could commit apart"
            )
        try:
            event_id = self.event_id(message)
        except BadEventId as e:
            yield self._bad_id(e)
            return
        if asyncpg_like:
            try:
                fresh = await raw.fetchval(self._claim_sql, self.consumer, event_id) is not None
            except asyncpg.UndefinedTableError:
                raise _not_migrated(self.names) from None
        else:
            fresh = await self._claim_sqlalchemy(conn, event_id)
        self.counts["fresh" if fresh else "duplicate"] += 1
        yield fresh

    async def _claim_sqlalchemy(self, conn: AsyncSession | AsyncConnection, event_id: str) -> bool:
        from sqlalchemy import exc, text

        # Named parameters work with every SQLAlchemy PostgreSQL driver.
        sql = self._claim_sql.replace("$1", ":consumer").replace("$2", ":event_id")
        try:
            result = await conn.execute(
                text(sql), {"consumer": self.consumer, "event_id": event_id}
            )
        except exc.DBAPIError as e:
            code = getattr(e.orig, "sqlstate", None) or getattr(e.orig, "pgcode", None)
            if code == "42P01":  # undefined_table
                raise _not_migrated(self.names) from None
            raise
        return result.scalar() is not None

    async def apply(
        self,
        db: asyncpg.Pool | asyncpg.Connection,
        message: Any,
        handler: Callable[[asyncpg.Connection, Any], Awaitable[None]],
    ) -> bool:
        """Apply one message at most once: ``handler(conn, message)`` runs inside a new
        transaction with ``process``, only for a fresh event. Returns whether it was applied
        (committed). With a ``fast_path``, an id Redis has seen is skipped without touching
        the database, and the id is written to Redis only after the database commit."""
        event_id: str | None = None
        with contextlib.suppress(BadEventId):  # process() applies the policy below
            event_id = self.event_id(message)
        if (
            self.fast_path is not None
            and event_id is not None
            and await self.fast_path.seen(self, event_id)
        ):
            self.counts["duplicate_fast"] += 1
            return False
        async with (
            _connection(db) as conn,
            conn.transaction(),
            self.process(conn, message) as fresh,
        ):
            if fresh:
                await handler(conn, message)
        # Committed. Redis learns of the id only now, so "seen" in Redis implies "committed".
        if self.fast_path is not None and event_id is not None:
            await self.fast_path.remember(self, event_id)
        if fresh:
            self.counts["applied"] += 1
        return bool(fresh)

    async def purge(self, conn: asyncpg.Connection, older_than: timedelta) -> int:
        """``purge_inbox`` for this consumer's ids only."""
        return await purge_inbox(conn, older_than, names=self.names, consumer=self.consumer)


@contextlib.asynccontextmanager
async def _connection(db: asyncpg.Pool | asyncpg.Connection) -> AsyncIterator[asyncpg.Connection]:
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            yield conn
    else:
        yield db


# --- the Kafka loop ---------------------------------------------------------------------------


async def consume(
    consumer: Any,
    db: asyncpg.Pool | asyncpg.Connection,
    handler: Callable[[asyncpg.Connection, Any], Awaitable[None]],
    *,
    inbox: Inbox,
    max_records: int = 200,
    poll_timeout: float = 0.5,
) -> None:
    """Run an aiokafka consumer through the inbox until cancelled.

    ``consumer`` is a started ``AIOKafkaConsumer`` with ``enable_auto_commit=False`` and a
    ``group_id``. For each message, in order per partition: ``inbox.apply`` (its own
    transaction; ``handler(conn, message)`` runs only for a fresh event), then, once a
    partition's messages of the fetched batch are committed in the database, that
    partition's offset is committed. A crash anywhere in between only causes redeliveries,
    which the inbox skips.
    A handler error commits the offsets of the messages before it, then propagates.
    """
    if getattr(consumer, "_enable_auto_commit", False):
        raise ConfigurationError(
            "the Kafka consumer must have enable_auto_commit=False: with auto-commit, offsets "
            "can move before the database commit and a crash loses messages"
        )
    while True:
        batch = await consumer.getmany(timeout_ms=int(poll_timeout * 1000), max_records=max_records)
        for tp, records in batch.items():
            done: dict[TopicPartition, int] = {}
            try:
                for record in records:
                    await inbox.apply(db, record, handler)
                    done[tp] = record.offset + 1
            except Exception:
                with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                    await _commit(consumer, done)
                raise
            await _commit(consumer, done)


async def _commit(consumer: Any, offsets: dict[TopicPartition, int]) -> None:
    if not offsets:
        return
    try:
        await consumer.commit(offsets)
    except (kafka_errors.CommitFailedError, kafka_errors.IllegalStateError) as e:
        # A rebalance took the partitions away: their new owner gets these messages again
        # and the inbox skips them. Nothing is lost, so this is not an error of ours.
        log.warning(
            "offset commit after a rebalance failed (%s): the messages are redelivered "
            "and skipped by the inbox",
            type(e).__name__,
        )


# --- the Redis fast path ----------------------------------------------------------------------


class RedisSeen:
    """An optional pre-check in front of the inbox table: ids Redis has seen are skipped
    without a database transaction. The database stays the source of truth:

    - an id is written to Redis only after its database transaction committed, so "seen" in
      Redis implies the id is committed in the database;
    - Redis unreachable, slow (``timeout``), or emptied: the check answers "not seen" and the
      database decides, as without Redis. Losing Redis costs speed, never a double apply.

    Keys are ``{prefix}:{inbox target}:{consumer}:{event id}`` and expire after ``ttl``, which
    must be shorter than the inbox table's retention (otherwise nothing is lost, but Redis
    would skip what the database no longer knows; that is the same trade-off as retention).
    After restoring the consumer's database from a backup, delete these keys: Redis would
    otherwise vouch for ids the restored database no longer has. Needs
    ``pip install 'notify-outbox[redis]'``.
    """

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        ttl: timedelta = timedelta(days=1),
        prefix: str = "notify-outbox",
        timeout: float = 0.25,
    ) -> None:
        if ttl <= timedelta(0):
            raise ConfigurationError("ttl must be a positive duration")
        self.client = client
        self.ttl = ttl
        self.prefix = prefix
        self.timeout = timeout
        self.errors = 0
        self._down = False

    def key(self, inbox: Inbox, event_id: str) -> str:
        """The Redis key of one id of one inbox and consumer."""
        return f"{self.prefix}:{inbox.names.target}:{inbox.consumer}:{event_id}"

    async def seen(self, inbox: Inbox, event_id: str) -> bool:
        """True only if Redis answered that it has the id; False on any trouble."""
        result = await self._call(self.client.exists, self.key(inbox, event_id))
        return bool(result)

    async def remember(self, inbox: Inbox, event_id: str) -> None:
        """Record an id whose database transaction has committed (best effort)."""
        await self._call(self.client.set, self.key(inbox, event_id), b"1", ex=self.ttl)

    async def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            with anyio.fail_after(self.timeout):
                result = await fn(*args, **kwargs)
        except (RedisError, OSError, TimeoutError) as e:
            self.errors += 1
            if not self._down:
                # One line per outage: the database check carries on meanwhile.
                log.warning("Redis fast path unavailable (%s); checking the database only", e)
                self._down = True
            return None
        if self._down:
            log.info("Redis fast path available again")
            self._down = False
        return result
