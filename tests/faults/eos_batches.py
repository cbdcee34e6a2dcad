"""Whole batches, as a read_committed consumer sees them (issue #35): the two counts of the
exactly-once fault suite that the event checker (``checker.py``) cannot make, because they
need the relay's Kafka transactions, which its markers record.

- **torn batches**: a committed marker (slot, sequence, row ids) some of whose events are not
  visible: part of a transaction committed without the rest;
- **aborted reads**: a visible event that no committed marker lists: a record of a transaction
  that did not commit, read anyway (or one sent outside any transaction).

Read once every relay has stopped (no transaction open: the last stable offsets are the high
watermarks), with published rows kept (``NOTIFY_OUTBOX_KEEP_PUBLISHED``): the markers name
rows by id, the events carry their ``outbox-event-id``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer

from tests.faults.harness import connect, partitions

__all__ = ["BatchReport", "check_batches", "read_committed_records"]


@dataclass
class BatchReport:
    """What ``check_batches`` found; ``ok`` when no batch is torn and no read aborted."""

    markers: int = 0
    events: int = 0
    torn: list[tuple[int, int]] = field(default_factory=list)  # (slot, seq)
    aborted_reads: list[str] = field(default_factory=list)  # event ids

    @property
    def ok(self) -> bool:
        return self.markers > 0 and not self.torn and not self.aborted_reads

    def text(self) -> str:
        return (
            f"batches: {self.markers} committed markers, {self.events} distinct events visible; "
            f"torn batches {len(self.torn)} {self.torn[:5]}, aborted reads "
            f"{len(self.aborted_reads)} {self.aborted_reads[:5]}"
        )


async def read_committed_records(
    bootstrap: str, topic: str
) -> list[tuple[dict[str, bytes], bytes | None]]:
    """(headers, value) of every record a read_committed consumer sees in ``topic`` now
    (up to the last stable offsets)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level="read_committed"
    )
    await consumer.start()
    try:
        tps = await partitions(consumer, [topic])
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        out: list[tuple[dict[str, bytes], bytes | None]] = []
        while any([await consumer.position(tp) < end for tp, end in ends.items()]):
            for batch in (await consumer.getmany(*tps, timeout_ms=200)).values():
                out.extend((dict(r.headers), r.value) for r in batch)
        return out
    finally:
        await consumer.stop()


async def check_batches(
    dsn: str, bootstrap: str, topic: str, marker_topic: str, *, target: str = "public.outbox"
) -> BatchReport:
    """Compare the committed markers of outbox ``target`` with the events visible in
    ``topic`` (a test's only topic)."""
    async with connect(dsn) as conn:
        rows = await conn.fetch(
            "SELECT id, event_id::text AS e FROM outbox "
            "UNION ALL SELECT id, event_id::text FROM outbox_dead_letter"
        )
    event_of = {int(r["id"]): str(r["e"]) for r in rows}
    visible = {
        h["outbox-event-id"].decode()
        for h, _ in await read_committed_records(bootstrap, topic)
        if "outbox-event-id" in h
    }
    report = BatchReport(events=len(visible))
    marked: set[str] = set()
    for _, value in await read_committed_records(bootstrap, marker_topic):
        marker = json.loads(value or b"{}")
        if marker.get("outbox") != target:
            continue
        report.markers += 1
        ids = {event_of.get(int(i), f"row {i} (not in the outbox)") for i in marker["ids"]}
        marked |= ids
        if not ids <= visible:
            report.torn.append((int(marker["slot"]), int(marker["seq"])))
    report.aborted_reads = sorted(visible - marked)
    return report
