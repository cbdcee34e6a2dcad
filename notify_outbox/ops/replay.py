"""Replay: send published rows again, so that a consumer that lost data can be rebuilt
(``notify-outbox replay --topic T --since ... --until ...``).

Only rows kept by the retention setting (``keep_published`` > 0) can be replayed. They become
the very same Kafka records as when the relay first sent them (``to_message``: key, value,
headers, ``outbox-event-id``), sent by the same idempotent producer (``KafkaPublisher``), in id
order, one batch acknowledged before the next is sent: per key, in commit order. Consumers
that drop repeats by event id see nothing new; a consumer rebuilding its state reads them as
the events they are.

A replay only reads the outbox (its session is read-only): rows keep their state, and the relay
runs on meanwhile. The range is on ``published_at`` (when the relay marked the row, which the
published index serves), ``since`` included, ``until`` excluded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import anyio
import asyncpg

from notify_outbox.core.errors import NotifyOutboxError
from notify_outbox.core.outbox import OutboxRow
from notify_outbox.core.settings import OutboxSettings
from notify_outbox.kafka.publisher import KafkaPublisher, Publisher
from notify_outbox.pg.sqlfiles import Queries
from notify_outbox.relay.outage import tame_third_party_logs

__all__ = ["NothingToReplay", "ReplayReport", "replay"]

log = logging.getLogger("notify_outbox.replay")


class NothingToReplay(NotifyOutboxError):
    """No kept published row matches: the message says what is kept, if anything."""


@dataclass
class ReplayReport:
    """What a replay did (or, in a dry run, would do)."""

    topic: str
    since: datetime
    until: datetime
    matched: int = 0  # rows in the range when the replay started
    sent: int = 0  # acknowledged by Kafka
    first_id: int | None = None
    last_id: int | None = None
    #: Rows Kafka did not take (id, reason); the replay stops at the first batch with any.
    failed: list[tuple[int, str]] = field(default_factory=list)
    dry_run: bool = False
    #: Set when part of the range is older than keep_published: those rows may be gone.
    partial: str | None = None

    @property
    def ok(self) -> bool:
        """Whether every row still kept was sent. (Fewer than ``matched`` are sent when
        retention deletes some of them during the replay.)"""
        return not self.failed


def _when(t: datetime) -> str:
    return t.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


async def replay(
    conn: asyncpg.Connection,
    settings: OutboxSettings,
    *,
    topic: str,
    since: datetime,
    until: datetime | None = None,
    dry_run: bool = False,
    batch_size: int | None = None,
    publisher: Publisher | None = None,
    progress: Callable[[ReplayReport], None] | None = None,
) -> ReplayReport:
    """Send the kept rows of ``topic`` published in [``since``, ``until``) again, in id order.

    Raises NothingToReplay when no such row is kept. ``publisher``: a started publisher to use
    (default: a ``KafkaPublisher`` on ``settings``, started and stopped here, which gives up
    after ``kafka_send_timeout`` if Kafka cannot be reached). ``progress`` is called after every
    acknowledged batch.
    """
    q = Queries(settings.names)
    end = until if until is not None else datetime.now(UTC)
    if end <= since:
        raise ValueError(f"--until ({_when(end)}) must be after --since ({_when(since)})")
    report = ReplayReport(topic, since, end, dry_run=dry_run)
    span = (await _read(conn, q["replay_range"], topic, since, end))[0]
    report.matched = int(span["rows"])
    if report.matched == 0:
        raise NothingToReplay(await _why_nothing(conn, q, settings, report))
    report.first_id, report.last_id = int(span["first_id"]), int(span["last_id"])
    if settings.keep_published > 0:
        kept_from = datetime.now(UTC) - timedelta(seconds=settings.keep_published)
        if since < kept_from:
            report.partial = (
                f"rows published before {_when(kept_from)} are deleted by retention "
                f"(NOTIFY_OUTBOX_KEEP_PUBLISHED={settings.keep_published:g}s): only the "
                "rows still kept are replayed"
            )
    if dry_run:
        return report
    with tame_third_party_logs():  # aiokafka logs every failed connection attempt
        if publisher is not None:
            await _send(conn, q, publisher, report, batch_size or settings.batch_size, progress)
            return report
        kafka = KafkaPublisher(settings)
        try:
            with anyio.fail_after(settings.kafka_send_timeout):
                await kafka.start()
        except TimeoutError:
            raise NotifyOutboxError(
                f"cannot reach Kafka at {settings.kafka_bootstrap_servers} within "
                f"{settings.kafka_send_timeout:g}s (NOTIFY_OUTBOX_KAFKA_SEND_TIMEOUT)"
            ) from None
        try:
            await _send(conn, q, kafka, report, batch_size or settings.batch_size, progress)
        finally:
            await kafka.stop(settings.shutdown_timeout)
    return report


async def _read(conn: asyncpg.Connection, sql: str, *args: object) -> list[asyncpg.Record]:
    # Nothing here may change a row: each read is its own short read-only transaction (not a
    # session setting, which a transaction-pooling PgBouncer would leave to other clients).
    async with conn.transaction(readonly=True):
        return list(await conn.fetch(sql, *args))


async def _send(
    conn: asyncpg.Connection,
    q: Queries,
    publisher: Publisher,
    report: ReplayReport,
    batch_size: int,
    progress: Callable[[ReplayReport], None] | None,
) -> None:
    assert report.first_id is not None
    assert report.last_id is not None
    after = report.first_id - 1
    while True:
        records = await _read(
            conn,
            q["replay_rows"],
            report.topic,
            report.since,
            report.until,
            after,
            report.last_id,
            batch_size,
        )
        if not records:
            return
        # Positional: replay_rows has OutboxRow's columns in its field order.
        rows = [OutboxRow(*r) for r in records]
        result = await publisher.publish(rows)
        delivered = set(result.delivered)
        report.sent += len(delivered)
        reasons = dict(result.failed) | dict(result.rejected)
        for row in rows:
            if row.id not in delivered:
                why = reasons.get(row.id) or result.unavailable or "not sent"
                report.failed.append((row.id, why))
        if report.failed:
            # Later rows of a failed row's key must not overtake it: stop here, the whole
            # replay can be run again (consumers drop what they already have).
            log.error(
                "replay stopped: %d rows of batch %d..%d not acknowledged",
                len(report.failed),
                rows[0].id,
                rows[-1].id,
                extra={"topic": report.topic, "row_ids": [i for i, _ in report.failed[:20]]},
            )
            return
        if progress is not None:
            progress(report)
        after = rows[-1].id


async def _why_nothing(
    conn: asyncpg.Connection, q: Queries, settings: OutboxSettings, report: ReplayReport
) -> str:
    where = (
        f"no published row of topic {report.topic!r} between {_when(report.since)} and "
        f"{_when(report.until)} is kept"
    )
    kept = (await _read(conn, q["replay_kept"]))[0]
    if kept["earliest"] is None:
        if settings.keep_published == 0:
            return (
                f"nothing to replay: {where}. No published row is kept at all: the relay "
                "deletes rows on publish unless NOTIFY_OUTBOX_KEEP_PUBLISHED is set (seconds "
                "to keep them), and it is 0 here"
            )
        return f"nothing to replay: {where}. No published row is kept at all"
    return (
        f"nothing to replay: {where}. Kept published rows (all topics) span "
        f"{_when(kept['earliest'])} to {_when(kept['latest'])}"
    )
