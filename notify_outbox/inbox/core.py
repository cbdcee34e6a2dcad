"""The ``Inbox``: records each event id in the consumer's own transaction, so a repeat finds its
id and is skipped (``apply``, ``apply_each``, ``apply_batch``, ``process``). The package's
docstring (``notify_outbox/inbox/__init__.py``) shows it in use."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import json
import logging
import re
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, Protocol

import anyio
import asyncpg

from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.message import EVENT_ID_HEADER

from .errors import BadEventId, HandlerFailed, InboxError, InTransaction, NotInTransaction
from .schema import InboxNames, _not_migrated, _queries, purge_inbox

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    from .redis_seen import RedisSeen

__all__ = [
    "OUTBOX_EVENT_ID_HEADER",
    "BatchHandler",
    "BatchResult",
    "Inbox",
    "InboxMessage",
    "MessageHandler",
    "OnError",
]

log = logging.getLogger("notify_outbox.inbox")

# The header the relay puts on every record (publisher.to_message): the outbox row's event_id.
OUTBOX_EVENT_ID_HEADER = EVENT_ID_HEADER  # the relay's own (message.py)
# Canonical text form of a UUID, as the relay writes it; any case is accepted and lowered.
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)
# The table's CHECK constraint: a btree entry must stay well under PostgreSQL's ~2.7 kB limit.
MAX_ID_BYTES = 512


@dataclass
class BatchResult:
    """What ``Inbox.apply_each`` / ``apply_batch`` did with a batch."""

    done: int = 0  # leading messages finished (applied, repeats, skipped, dead-lettered)
    applied: int = 0  # fresh messages whose handler's changes committed
    duplicates: int = 0  # repeats skipped (in the table, earlier in the batch, or in Redis)
    dead_lettered: int = 0  # recorded in the dead-letter table (on_error="dead_letter")


MessageHandler = Callable[[asyncpg.Connection, Any], Awaitable[None]]
BatchHandler = Callable[[asyncpg.Connection, list[Any]], Awaitable[None]]
OnError = Literal["stop", "dead_letter"]
# Transaction conflicts a new attempt resolves: REPEATABLE READ / SERIALIZABLE races, deadlocks.
_RETRYABLE = (asyncpg.SerializationError, asyncpg.DeadlockDetectedError)


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
    - ``fast_path``: an optional ``RedisSeen``, used by ``apply``, ``apply_each``,
      ``apply_batch`` and the ``consume`` loops.
    - ``retries``: how many times ``apply``/``apply_each``/``apply_batch`` run a transaction
      again after a serialization failure or a deadlock (default 5).

    ``counts`` holds counters: ``fresh`` and ``duplicate`` (what ``process`` or a batch
    found), ``applied`` (committed by ``apply`` or a batch), ``duplicate_fast`` (skipped on
    Redis's word), ``dead_lettered``, ``retried``, ``bad_id_skipped``, ``bad_id_applied``.
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
        retries: int = 5,
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
        if retries < 0:
            raise ConfigurationError("retries must be at least 0")
        self.retries = retries
        self.counts: Counter[str] = Counter()
        # The Redis key scope of each pool or connection seen (see RedisSeen).
        self._scopes: dict[int, tuple[object, str]] = {}
        self.last_scope: str | None = None

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
        handler: MessageHandler,
    ) -> bool:
        """Apply one message at most once: ``handler(conn, message)`` runs inside a new
        transaction with ``process``, only for a fresh event. Returns whether it was applied
        (committed). With a ``fast_path``, an id Redis has seen is skipped without touching
        the database, and the id is written to Redis only after the database commit.

        ``db`` must not be inside a transaction (``InTransaction``): the "commit" would only
        release a savepoint, and Redis and the Kafka offset would move before the outer
        transaction commits. A serialization failure or deadlock (REPEATABLE READ or
        SERIALIZABLE, a concurrent consumer) is retried up to ``retries`` times."""
        event_id: str | None = None
        with contextlib.suppress(BadEventId):  # process() applies the policy below
            event_id = self.event_id(message)
        scope = None
        if self.fast_path is not None and event_id is not None:
            scope = await self.key_scope(db)
            if await self.fast_path.seen(self, event_id, scope):
                self.counts["duplicate_fast"] += 1
                return False
        for attempt in itertools.count():
            try:
                async with _connection(db) as conn:
                    _refuse_open_transaction(conn)
                    async with conn.transaction(), self.process(conn, message) as fresh:
                        if fresh:
                            await handler(conn, message)
                break
            except _RETRYABLE as e:
                await self._before_retry(attempt, e)
        # Committed. Redis learns of the id only now, so "seen" in Redis implies "committed".
        if self.fast_path is not None and event_id is not None:
            await self.fast_path.remember(self, event_id, scope)
        if fresh:
            self.counts["applied"] += 1
        return bool(fresh)

    async def apply_each(
        self,
        db: asyncpg.Pool | asyncpg.Connection,
        messages: Sequence[Any],
        handler: MessageHandler,
        *,
        on_error: OnError = "stop",
    ) -> BatchResult:
        """Apply a batch of messages (one partition's, in order) at most once each, in one
        transaction: the ids are claimed in one statement, then ``handler(conn, message)`` runs
        for each fresh message, in order, in that transaction.

        A handler error rolls the batch back; the messages before the failing one are then
        applied in a transaction of their own, and the failing one follows ``on_error``:
        ``"stop"`` raises ``HandlerFailed`` (its ``result.done`` says how many leading messages
        are finished), ``"dead_letter"`` records it in the ``<table>_dead_letter`` table with
        its id, and the rest of the batch is applied. See ``apply_batch`` for the rest."""
        return await self._apply_many(db, messages, handler, per_message=True, on_error=on_error)

    async def apply_batch(
        self,
        db: asyncpg.Pool | asyncpg.Connection,
        messages: Sequence[Any],
        handler: BatchHandler,
        *,
        on_error: OnError = "stop",
    ) -> BatchResult:
        """Apply a batch of messages (one partition's, in order) at most once each, in one
        transaction: the ids are claimed in one statement and ``handler(conn, fresh)`` gets
        only the fresh messages (in order, each id once), so it can write them in bulk.

        A handler error rolls the whole batch back and the batch is split in halves, each
        applied in its own transaction, until the failing message is found (a handler that
        fails for one message fails for every part holding it). The messages before it stay
        applied; the failing one follows ``on_error`` (``"stop"``: ``HandlerFailed``;
        ``"dead_letter"``: recorded in ``<table>_dead_letter`` in the transaction that claims
        its id, so a redelivery is a repeat; then the rest is applied).

        A bad id under ``on_bad_id="raise"`` ends the batch there: the messages before it are
        applied, then ``BadEventId`` is raised (with ``result``). Serialization failures and
        deadlocks are retried (``retries``). With a ``fast_path``, ids Redis has seen are
        dropped before the transaction, and the committed ids are written to Redis after it.
        Raises ``InTransaction`` for a connection inside a transaction."""
        return await self._apply_many(db, messages, handler, per_message=False, on_error=on_error)

    async def claim_batch(self, conn: asyncpg.Connection, event_ids: Sequence[str]) -> set[str]:
        """Record ``event_ids`` (distinct) in the caller's transaction, in one statement;
        returns those that were not there before (the fresh ones)."""
        try:
            rows = await conn.fetch(self._queries["claim_many"], self.consumer, list(event_ids))
        except asyncpg.UndefinedTableError:
            raise _not_migrated(self.names) from None
        return {r[0] for r in rows}

    @cached_property
    def _queries(self) -> dict[str, str]:
        return _queries(self.names)

    async def _before_retry(self, attempt: int, error: Exception) -> None:
        if attempt >= self.retries:
            raise error
        self.counts["retried"] += 1
        log.info("%s: retrying the transaction (%d)", type(error).__name__, attempt + 1)
        # A short, growing pause, so that the concurrent transaction can finish first.
        await anyio.sleep(min(0.5, 0.01 * 2**attempt))

    async def key_scope(self, db: asyncpg.Pool | asyncpg.Connection) -> str:
        """The scope of this inbox's Redis keys in ``db``'s database: a hash of the database's
        identity (cluster system identifier, database oid) and the inbox table. Looked up once
        per pool or connection."""
        target: Any = getattr(db, "_con", None) or db  # a pool's connection proxy: its connection
        found = self._scopes.get(id(target))
        if found is not None and found[0] is target:
            return found[1]
        async with _connection(db) as conn:
            ident = await conn.fetchval(self._queries["identity"])
        scope = hashlib.sha256(f"{ident}/{self.names.target}".encode()).hexdigest()[:16]
        if len(self._scopes) > 64:  # short-lived connections: keep the cache small
            self._scopes.clear()
        self._scopes[id(target)] = (target, scope)
        self.last_scope = scope
        return scope

    async def _apply_many(
        self,
        db: asyncpg.Pool | asyncpg.Connection,
        messages: Sequence[Any],
        handler: Callable[[asyncpg.Connection, Any], Awaitable[None]],
        *,
        per_message: bool,
        on_error: OnError,
    ) -> BatchResult:
        if on_error not in ("stop", "dead_letter"):
            raise ConfigurationError(f"on_error must be 'stop' or 'dead_letter', not {on_error!r}")
        result = BatchResult()
        items: list[_Item] = []
        stop: InboxError | None = None
        stop_at: int | None = None
        for index, message in enumerate(messages):
            try:
                items.append(_Item(index, message, self.event_id(message)))
            except BadEventId as e:
                if self.on_bad_id == "raise":
                    # The messages before it are applied, then it is raised.
                    stop, stop_at = e, index
                    break
                if self._bad_id(e):
                    items.append(_Item(index, message, None))  # applied, not deduplicated
        end = len(messages) if stop_at is None else stop_at
        scope = None
        if self.fast_path is not None and items:
            scope = await self.key_scope(db)
            seen = await self.fast_path.seen_many(
                self, [i.event_id for i in items if i.event_id is not None], scope
            )
            if seen:
                kept = [i for i in items if i.event_id is None or i.event_id not in seen]
                self.counts["duplicate_fast"] += len(items) - len(kept)
                result.duplicates += len(items) - len(kept)
                items = kept
        call = _PerMessage(handler) if per_message else _Whole(handler)
        failure = await self._settle(db, items, call, on_error, result, scope)
        if failure is not None:
            item, error = failure
            result.done = item.index
            failed = HandlerFailed(
                f"the handler failed on {_describe(item.message)} "
                f"({type(error).__name__}: {error}); the {item.index} messages before it are "
                "applied, it and the ones after it are not",
                item.message,
            )
            failed.result = result
            raise failed from error
        result.done = end
        if stop is not None:
            stop.result = result
            raise stop
        return result

    async def _settle(
        self,
        db: asyncpg.Pool | asyncpg.Connection,
        items: list[_Item],
        call: _Call,
        on_error: OnError,
        result: BatchResult,
        scope: str | None,
    ) -> tuple[_Item, Exception] | None:
        """Apply ``items`` in order; on a handler error, split them to find the failing
        message. Returns that message and its error when it stops the batch."""
        if not items:
            return None
        try:
            await self._attempt(db, items, call, result, scope)
            return None
        except Exception as e:
            if not call.raised:
                raise  # not the handler's (the database, the inbox table): no message to blame
            error = e
        if len(items) == 1:
            if on_error == "stop":
                return items[0], error
            await self._attempt(db, items, call, result, scope, dead=error)
            return None
        # A per-message handler tells which message failed: try the ones before it, then it
        # alone. A batch handler does not: halve the batch (log2(n) transactions per failure).
        failed = call.failed
        if failed is not None and failed in items:
            cut = items.index(failed)
            pieces = [items[:cut], items[cut : cut + 1], items[cut + 1 :]]
        else:
            half = len(items) // 2
            pieces = [items[:half], items[half:]]
        for piece in pieces:
            outcome = await self._settle(db, piece, call, on_error, result, scope)
            if outcome is not None:
                return outcome
        return None

    async def _attempt(
        self,
        db: asyncpg.Pool | asyncpg.Connection,
        items: list[_Item],
        call: _Call,
        result: BatchResult,
        scope: str | None,
        *,
        dead: Exception | None = None,
    ) -> None:
        """One transaction over ``items`` (retried on serialization failures and deadlocks):
        claim the ids, run the handler for the fresh messages (or, with ``dead``, record the
        one message in the dead-letter table instead), commit."""
        for attempt in itertools.count():
            call.failed, call.raised = None, False
            try:
                async with _connection(db) as conn:
                    _refuse_open_transaction(conn)
                    async with conn.transaction():
                        fresh = await self._fresh(conn, items)
                        if dead is not None:
                            for item in fresh:
                                await self._dead_letter(conn, item, dead)
                        elif fresh:
                            try:
                                await call(conn, fresh)
                            except Exception:
                                call.raised = True
                                raise
                break
            except _RETRYABLE as e:
                await self._before_retry(attempt, e)
        # Committed.
        repeats = len(items) - len(fresh)
        result.duplicates += repeats
        self.counts["duplicate"] += repeats
        if dead is not None:
            result.dead_lettered += len(fresh)
            self.counts["dead_lettered"] += len(fresh)
        else:
            result.applied += len(fresh)
            self.counts["fresh"] += len(fresh)
            self.counts["applied"] += len(fresh)
        if self.fast_path is not None and scope is not None:
            await self.fast_path.remember_many(
                self, [i.event_id for i in items if i.event_id is not None], scope
            )

    async def _fresh(self, conn: asyncpg.Connection, items: list[_Item]) -> list[_Item]:
        ids = list(dict.fromkeys(i.event_id for i in items if i.event_id is not None))
        claimed = await self.claim_batch(conn, ids) if ids else set()
        fresh: list[_Item] = []
        for item in items:
            if item.event_id is None:
                fresh.append(item)
            elif item.event_id in claimed:
                claimed.discard(item.event_id)  # a repeat inside the batch is a repeat too
                fresh.append(item)
        return fresh

    async def _dead_letter(self, conn: asyncpg.Connection, item: _Item, error: Exception) -> None:
        message = item.message
        headers = [
            [k, base64.b64encode(bytes(v)).decode() if v is not None else None]
            for k, v in (getattr(message, "headers", None) or ())
        ]
        value = getattr(message, "value", None)
        event_id = item.event_id or (
            f"no-id:{getattr(message, 'topic', '')}:{getattr(message, 'partition', '')}:"
            f"{getattr(message, 'offset', '')}"
        )
        log.error(
            "%s: the handler failed (%s: %s); recorded in %s and skipped (on_error='dead_letter')",
            _describe(message),
            type(error).__name__,
            error,
            self.names.qualified_dead_letter,
        )
        await conn.execute(
            self._queries["dead_letter"],
            self.consumer,
            event_id,
            getattr(message, "topic", None),
            getattr(message, "partition", None),
            getattr(message, "offset", None),
            message.key,
            value if isinstance(value, bytes | None) else str(value).encode(),
            json.dumps(headers),
            f"{type(error).__name__}: {error}"[:10_000],
        )

    async def purge(self, conn: asyncpg.Connection, older_than: timedelta) -> int:
        """``purge_inbox`` for this consumer's ids only."""
        return await purge_inbox(conn, older_than, names=self.names, consumer=self.consumer)


@dataclass(eq=False)
class _Item:
    index: int  # position in the batch as given
    message: Any
    event_id: str | None  # None: a bad id applied without deduplication (on_bad_id="apply")


class _Call:
    """How a batch's fresh messages meet the handler; ``failed`` names the message a
    per-message handler failed on (None when unknown)."""

    failed: _Item | None = None
    raised = False  # whether the last attempt's error came out of the handler

    async def __call__(self, conn: asyncpg.Connection, fresh: list[_Item]) -> None:
        raise NotImplementedError


class _PerMessage(_Call):
    def __init__(self, handler: MessageHandler) -> None:
        self.handler = handler

    async def __call__(self, conn: asyncpg.Connection, fresh: list[_Item]) -> None:
        for item in fresh:
            self.failed = item
            await self.handler(conn, item.message)
        self.failed = None


class _Whole(_Call):
    def __init__(self, handler: BatchHandler) -> None:
        self.handler = handler

    async def __call__(self, conn: asyncpg.Connection, fresh: list[_Item]) -> None:
        await self.handler(conn, [i.message for i in fresh])


def _refuse_open_transaction(conn: Any) -> None:
    if conn.is_in_transaction():
        raise InTransaction(
            "the inbox was given a connection inside an open transaction: its commit would "
            "only release a savepoint, and Redis and the Kafka offset would move before your "
            "transaction commits (an event lost if it rolls back). Pass a pool or an idle "
            "connection, or use Inbox.process inside your own transaction and commit the "
            "offsets after it"
        )


@contextlib.asynccontextmanager
async def _connection(db: asyncpg.Pool | asyncpg.Connection) -> AsyncIterator[asyncpg.Connection]:
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            yield conn
    else:
        yield db
