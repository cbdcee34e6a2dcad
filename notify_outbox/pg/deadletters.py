"""Dead letters: list, show, requeue and purge them (``notify-outbox dead-letters ...``), and
their retention (``dead_letter_retention``, applied by the relay's cleanup).

Every function takes an asyncpg connection (or pool) and the outbox's names, so they work from
Python as well as from the command line::

    async for dead in list_dead_letters(conn, names, DeadLetterFilter(topic="orders")):
        ...
    moved = await requeue(conn, names, DeadLetterFilter(error="does not exist"))

**What a requeue means for per-key order.** A dead letter goes back into the outbox as a *new*
row at the *end* of its key's order: a new id, drawn by the ordering trigger under the key's
lock, with the same event id (the ``outbox-event-id`` header), payload and headers, and its
attempts reset. So:

- pending rows of its key (including rows waiting for a retry) go out before it;
- rows of its key that were published after it died stay published: the consumer receives the
  requeued event *after* them. That is the only order the relay can still keep; a consumer for
  which a late, older event matters must compare versions (or not be sent it: purge it);
- several dead letters of one key requeued together keep their relative order (they are moved
  in id order, one committed statement after the other);
- a dead letter that was sent before it died (an acknowledgement lost on the way) arrives
  twice, with the same event id: consumers drop repeats by it.

Each dead letter moves in one statement (a ``DELETE ... RETURNING`` feeding an ``INSERT``), so
a crash or a concurrent requeue never loses or duplicates it. A dead letter whose idempotency
key is held by a row now in the outbox stays where it is, and is reported as skipped.
"""

from __future__ import annotations

import base64
import json
import logging
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from notify_outbox.core.events import RelayEvents
from notify_outbox.core.names import OutboxNames
from notify_outbox.core.settings import OutboxSettings
from notify_outbox.core.timespec import format_duration

from .sqlfiles import Queries

__all__ = [
    "DeadLetter",
    "DeadLetterFilter",
    "RequeueResult",
    "count_dead_letters",
    "expire_dead_letters",
    "get_dead_letter",
    "list_dead_letters",
    "purge",
    "report_expired",
    "requeue",
]

log = logging.getLogger("notify_outbox.deadletters")

_MAX_ID = 2**63 - 1
_PAGE = 500


@dataclass(frozen=True)
class DeadLetterFilter:
    """Which dead letters a command applies to; every field left as None matches all.

    ``error`` matches text anywhere in the error, in any case. ``since`` / ``until`` bound the
    time of the dead-lettering (``since`` included, ``until`` excluded); ``older_than`` keeps
    the dead letters dead-lettered longer ago than that (measured with the database's clock).
    """

    ids: Sequence[int] | None = None
    topic: str | None = None
    key: str | None = None
    error: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    older_than: timedelta | None = None

    @property
    def empty(self) -> bool:
        """Whether the filter matches every dead letter."""
        return all(
            v is None
            for v in (
                self.ids,
                self.topic,
                self.key,
                self.error,
                self.since,
                self.until,
                self.older_than,
            )
        )

    def params(self) -> tuple[Any, ...]:
        """The filter as the $1..$7 of the ``dead_letters_*`` queries."""
        return (
            None if self.ids is None else [int(i) for i in self.ids],
            self.topic,
            self.key,
            self.error,
            self.since,
            self.until,
            None if self.older_than is None else self.older_than.total_seconds(),
        )


@dataclass(frozen=True)
class DeadLetter:
    """One row of the dead-letter table."""

    id: int
    event_id: str
    topic: str
    key: str | None
    payload: str | None  # jsonb as JSON text
    payload_bytes: bytes | None
    headers: str | None  # jsonb object as JSON text
    event_type: str | None
    aggregate_type: str | None
    aggregate_id: str | None
    idempotency_key: str | None
    created_at: datetime
    attempts: int
    error: str
    dead_lettered_at: datetime

    @classmethod
    def from_record(cls, r: asyncpg.Record) -> DeadLetter:
        """A dead letter from a ``dead_letters_list`` row."""
        return cls(**{**dict(r), "event_id": str(r["event_id"])})

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: times in ISO-8601, the payload as its JSON value (or
        ``payload_base64`` for ``payload_bytes``), the headers as an object."""
        doc: dict[str, Any] = {
            "id": self.id,
            "event_id": self.event_id,
            "topic": self.topic,
            "key": self.key,
            "attempts": self.attempts,
            "error": self.error,
            "created_at": self.created_at.isoformat(),
            "dead_lettered_at": self.dead_lettered_at.isoformat(),
            "event_type": self.event_type,
            "aggregate_type": self.aggregate_type,
            "aggregate_id": self.aggregate_id,
            "idempotency_key": self.idempotency_key,
            "headers": None if self.headers is None else json.loads(self.headers),
        }
        if self.payload_bytes is not None:
            doc["payload_base64"] = base64.b64encode(self.payload_bytes).decode()
        else:
            doc["payload"] = None if self.payload is None else json.loads(self.payload)
        return doc


@dataclass(frozen=True)
class RequeueResult:
    """What happened to one dead letter: moved to outbox row ``outbox_id``, or ``skipped``
    (why), or, in a dry run, neither."""

    dead_letter_id: int
    topic: str
    key: str | None
    event_id: str
    outbox_id: int | None = None
    skipped: str | None = None


def _matching(names: OutboxNames, name: str) -> str:
    """Query ``name`` with the shared dead-letter filter (``dead_letters_match``) in place of
    its ``<match>``."""
    q = Queries(names)
    return q[name].replace("<match>", f"({q['dead_letters_match']})")


async def list_dead_letters(
    conn: asyncpg.Connection | asyncpg.Pool,
    names: OutboxNames,
    where: DeadLetterFilter | None = None,
    *,
    after_id: int = 0,
    up_to_id: int = _MAX_ID,
    limit: int | None = None,
) -> AsyncIterator[DeadLetter]:
    """The matching dead letters in id order, read a page at a time (any table size), with
    ids after ``after_id`` and at most ``up_to_id``; at most ``limit`` of them (None: all)."""
    sql = _matching(names, "dead_letters_list")
    params = (where or DeadLetterFilter()).params()
    left = math.inf if limit is None else limit
    while left > 0:
        page = int(min(left, _PAGE))
        rows = await conn.fetch(sql, *params, after_id, up_to_id, page)
        for r in rows:
            yield DeadLetter.from_record(r)
        if len(rows) < page:
            return
        left -= len(rows)
        after_id = rows[-1]["id"]


async def get_dead_letter(
    conn: asyncpg.Connection | asyncpg.Pool, names: OutboxNames, dead_letter_id: int
) -> DeadLetter | None:
    """One dead letter by id, or None."""
    async for dead in list_dead_letters(
        conn, names, DeadLetterFilter(ids=[dead_letter_id]), limit=1
    ):
        return dead
    return None


async def count_dead_letters(
    conn: asyncpg.Connection | asyncpg.Pool,
    names: OutboxNames,
    where: DeadLetterFilter | None = None,
    *,
    limit: int = 100_000,
) -> int:
    """Matching dead letters, counted up to ``limit`` (bounded work at any table size)."""
    sql = _matching(names, "dead_letters_count")
    return int(await conn.fetchval(sql, *(where or DeadLetterFilter()).params(), limit))


async def requeue(
    conn: asyncpg.Connection,
    names: OutboxNames,
    where: DeadLetterFilter,
    *,
    dry_run: bool = False,
) -> list[RequeueResult]:
    """Move the matching dead letters back into the outbox, in id order, each at the end of
    its key's order (see the module's docstring). With ``dry_run``, nothing changes and the
    results say what would move. Ids asked for that are not dead letters come back as
    skipped ("not found")."""
    q = Queries(names)
    # Rows that die again once requeued get new, larger ids: stop at today's last one.
    last_id = int(await conn.fetchval(q["dead_letters_last_id"]))
    results: list[RequeueResult] = []
    async for dead in list_dead_letters(conn, names, where, up_to_id=last_id):
        result = RequeueResult(dead.id, dead.topic, dead.key, dead.event_id)
        if not dry_run:
            # One statement: the move commits whole or not at all.
            new_id = await conn.fetchval(q["requeue_dead"], dead.id)
            if new_id is not None:
                result = RequeueResult(dead.id, dead.topic, dead.key, dead.event_id, new_id)
            else:
                still = await get_dead_letter(conn, names, dead.id)
                why = (
                    f"idempotency key {dead.idempotency_key!r} is held by a row in the outbox"
                    if still is not None
                    else "no longer a dead letter (requeued or purged meanwhile)"
                )
                result = RequeueResult(dead.id, dead.topic, dead.key, dead.event_id, skipped=why)
        results.append(result)
    if where.ids is not None:
        seen = {r.dead_letter_id for r in results}
        for missing in sorted(set(where.ids) - seen):
            results.append(RequeueResult(missing, "", None, "", skipped="not found"))
    return results


async def purge(
    conn: asyncpg.Connection | asyncpg.Pool,
    names: OutboxNames,
    where: DeadLetterFilter,
    *,
    dry_run: bool = False,
    batch: int = 5000,
    count_limit: int = 10_000_000,
) -> int:
    """Delete the matching dead letters, ``batch`` rows per statement (short transactions);
    returns how many. With ``dry_run``, only counts them (up to ``count_limit``)."""
    if dry_run:
        return await count_dead_letters(conn, names, where, limit=count_limit)
    sql = _matching(names, "dead_letters_purge")
    params = where.params()
    total = 0
    while True:
        status = await conn.execute(sql, *params, batch)
        deleted = int(status.split()[-1])
        total += deleted
        if deleted < batch:
            return total


async def expire_dead_letters(
    conn: asyncpg.Connection | asyncpg.Pool, settings: OutboxSettings, events: RelayEvents
) -> int:
    """Retention: delete the dead letters dead-lettered more than ``dead_letter_retention``
    ago, ``cleanup_batch`` rows per statement. Emits ``cleanup_dead_letters`` (rows) and logs
    how many went. (The relay's cleanup does the same through its store.)"""
    if settings.dead_letter_retention is None:
        return 0
    where = DeadLetterFilter(older_than=timedelta(seconds=settings.dead_letter_retention))
    deleted = await purge(conn, settings.names, where, batch=settings.cleanup_batch)
    report_expired(deleted, settings.dead_letter_retention, events)
    return deleted


def report_expired(deleted: int, retention: float, events: RelayEvents) -> None:
    """Emit ``cleanup_dead_letters`` and log the dead letters retention deleted (if any)."""
    if deleted:
        events.emit("cleanup_dead_letters", deleted)
        log.info(
            "deleted %d dead letters older than %s (dead_letter_retention)",
            deleted,
            format_duration(retention),
            extra={"rows": deleted, "retention_seconds": retention},
        )
