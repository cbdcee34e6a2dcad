"""`notify-outbox replay`: kept published rows sent to Kafka again, as the same records with
the same event ids, in per-key order, without touching the rows; and clear refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import asyncpg
import pytest
from aiokafka import ConsumerRecord

from notify_outbox import OutboxSettings, Relay
from tests.conftest import Services
from tests.support import ROOT, consume, header, topic_total


def replay_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "notify_outbox", "replay", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("NOTIFY_OUTBOX_")},
            "PYTHONPATH": str(ROOT),
            **env,
        },
        timeout=120,
    )


async def areplay(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(lambda: replay_cli(*args, env=env))


def _record_view(r: ConsumerRecord[bytes, bytes]) -> tuple[Any, ...]:
    return (r.key, r.value, tuple(r.headers or ()))


async def _rows_state(dsn: str) -> list[tuple[Any, ...]]:
    conn = await asyncpg.connect(dsn)
    try:
        return [
            tuple(r)
            for r in await conn.fetch(
                "SELECT id, event_id, published_at, attempts, next_attempt_at FROM outbox "
                "ORDER BY id"
            )
        ]
    finally:
        await conn.close()


@pytest.mark.anyio
async def test_replay_sends_kept_rows_again_as_the_same_records_in_key_order(
    db_dsn: str, services: Services, topic: str
) -> None:
    """The relay publishes 300 events over 7 keys and keeps them (keep_published); `replay`
    sends each again: same key, value and headers (event id, type, custom headers), and per
    key the replayed events come in the same order as the first time. The rows are left as
    they were, and the relay keeps running meanwhile."""
    total = 300
    settings = OutboxSettings(
        dsn=db_dsn,
        kafka_bootstrap_servers=services.bootstrap,
        workers=2,
        keep_published=3600,
    )
    conn = await asyncpg.connect(db_dsn)
    try:
        async with Relay(settings) as relay:
            await conn.execute(
                "INSERT INTO outbox (topic, key, payload, headers, event_type, payload_bytes) "
                "SELECT $1, 'k' || (i % 7), CASE WHEN i % 10 <> 0 THEN jsonb_build_object('i', i) "
                "END, jsonb_build_object('trace', 't' || i), 'Thing', "
                "CASE WHEN i % 10 = 0 THEN int4send(i) END "
                "FROM generate_series(1, $2) AS i",
                topic,
                total,
            )
            first, _ = await consume(services.bootstrap, topic, expect=total, within=60)
            with anyio.fail_after(30):
                await relay.events.wait_for("published", total)
            before = await _rows_state(db_dsn)
            result = await areplay(
                "--topic",
                topic,
                "--since",
                "1h",
                env={
                    "NOTIFY_OUTBOX_DSN": db_dsn,
                    "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.bootstrap,
                    "NOTIFY_OUTBOX_KEEP_PUBLISHED": "3600",
                    "NOTIFY_OUTBOX_BATCH_SIZE": "64",  # several batches
                },
            )
            assert result.returncode == 0, result.stderr
            records, _ = await consume(services.bootstrap, topic, expect=2 * total, within=60)
            after = await _rows_state(db_dsn)
        in_kafka = await topic_total(services.bootstrap, topic)  # the relay stopped
    finally:
        await conn.close()
    assert result.stdout.startswith(f"replayed {total} of {total} rows of topic {topic} ")
    assert result.stdout.rstrip().endswith("with their event ids")
    assert in_kafka == 2 * total, "nothing but the replay was sent"
    assert before == after, "a replay must not change the rows"
    assert len(before) == total

    by_event: dict[str, list[ConsumerRecord[bytes, bytes]]] = defaultdict(list)
    for r in records:
        by_event[header(r, "outbox-event-id") or ""].append(r)
    assert len(by_event) == total
    for event_id, copies in by_event.items():
        assert len(copies) == 2, event_id
        assert _record_view(copies[0]) == _record_view(copies[1])
        assert copies[0].partition == copies[1].partition
        assert header(copies[1], "outbox-event-type") == "Thing"
    sample = next(iter(by_event.values()))[1]
    assert header(sample, "trace") is not None

    # Per key: the replay repeats the first pass's order (offsets within each partition).
    per_key: dict[bytes, list[str]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        assert r.key is not None
        per_key[r.key].append(header(r, "outbox-event-id") or "")
    for key, events in per_key.items():
        half = len(events) // 2
        assert events[:half] == events[half:], f"key {key!r}: the replay changed the order"
    assert sum(len(v) for v in per_key.values()) == 2 * total
    # ...and the first pass itself was in id order, per key.
    assert {header(r, "outbox-event-id") for r in first} == set(by_event)
    id_of = {str(row[1]): row[0] for row in before}
    first_ids: dict[bytes, list[int]] = defaultdict(list)
    for r in sorted(first, key=lambda r: (r.partition, r.offset)):
        assert r.key is not None
        first_ids[r.key].append(id_of[header(r, "outbox-event-id") or ""])
    assert len(first_ids) == 7
    for key, ids in first_ids.items():
        assert ids == sorted(ids), f"key {key!r}: the first pass was not in id order"


@pytest.mark.anyio
async def test_replay_takes_only_the_range_and_dry_run_sends_nothing(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Rows kept with published_at 3 days, 2 days and 1 hour ago (and a pending row, and a
    row of another topic): `--since 50h --until 1d` takes the 2-day-old ones only."""
    now = datetime.now(UTC)
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.executemany(
            "INSERT INTO outbox (topic, key, payload, published_at) VALUES ($1, $2, $3, $4)",
            [
                (topic, "a", json.dumps({"when": "3d"}), now - timedelta(days=3)),
                (topic, "a", json.dumps({"when": "2d"}), now - timedelta(days=2)),
                (topic, "b", json.dumps({"when": "2d"}), now - timedelta(days=2)),
                ("other", "a", json.dumps({"when": "2d"}), now - timedelta(days=2)),
                (topic, "a", json.dumps({"when": "1h"}), now - timedelta(hours=1)),
            ],
        )
        await conn.execute("INSERT INTO outbox (topic, key, payload) VALUES ($1, 'a', '0')", topic)
    finally:
        await conn.close()
    env = {
        "NOTIFY_OUTBOX_DSN": db_dsn,
        "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.bootstrap,
        "NOTIFY_OUTBOX_KEEP_PUBLISHED": str(7 * 86400),
    }
    args = ("--topic", topic, "--since", "50h", "--until", "1d")
    dry = await areplay(*args, "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(f"dry run: 2 rows of topic {topic} published from ")
    assert dry.stdout.rstrip().endswith("would be sent again; nothing sent")
    _, in_kafka = await consume(services.bootstrap, topic, expect=0, within=10)
    assert in_kafka == 0

    done = await areplay(*args, env=env)
    assert done.returncode == 0, done.stderr
    records, in_kafka = await consume(services.bootstrap, topic, expect=2, within=30)
    assert in_kafka == 2
    assert sorted(json.loads(r.value or b"")["when"] for r in records) == ["2d", "2d"]
    assert sorted(r.key or b"" for r in records) == [b"a", b"b"]

    # keep_published of 1 day: the range reaches further back than what is kept.
    partial = await areplay(
        "--topic",
        topic,
        "--since",
        "4d",
        "--dry-run",
        env={**env, "NOTIFY_OUTBOX_KEEP_PUBLISHED": "86400"},
    )
    assert partial.returncode == 0
    assert "warning: rows published before" in partial.stderr
    assert "dry run: 4 rows" in partial.stdout


@pytest.mark.anyio
async def test_replay_refuses_clearly_when_nothing_is_kept(
    db_dsn: str, services: Services, topic: str
) -> None:
    env = {
        "NOTIFY_OUTBOX_DSN": db_dsn,
        "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.bootstrap,
    }
    nothing = await areplay("--topic", topic, "--since", "7d", env=env)
    assert nothing.returncode == 1
    assert nothing.stderr.count("\n") == 1, nothing.stderr
    assert "nothing to replay" in nothing.stderr
    assert "NOTIFY_OUTBOX_KEEP_PUBLISHED" in nothing.stderr
    assert "Traceback" not in nothing.stderr

    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            "INSERT INTO outbox (topic, payload, published_at) "
            "VALUES ($1, '1', now() - interval '3 days')",
            topic,
        )
    finally:
        await conn.close()
    elsewhere = await areplay(
        "--topic", topic, "--since", "1d", env={**env, "NOTIFY_OUTBOX_KEEP_PUBLISHED": "604800"}
    )
    assert elsewhere.returncode == 1
    assert "nothing to replay" in elsewhere.stderr
    assert "Kept published rows (all topics) span" in elsewhere.stderr
    _, in_kafka = await consume(services.bootstrap, topic, expect=0, within=10)
    assert in_kafka == 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--topic", "t", "--since", "2d", "--until", "3d"], "must be after --since"),
        (["--topic", "t", "--since", "last week"], "--since: invalid time 'last week'"),
        (["--topic", "t"], "the following arguments are required: --since"),
        (["--since", "1d"], "the following arguments are required: --topic"),
        (["--topic", "t", "--since", "1d", "--kafka-bootstrap-servers", "nohost"], "host:port"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(services: Services, args: list[str], says: str) -> None:
    result = replay_cli(
        *args,
        env={
            "NOTIFY_OUTBOX_DSN": "postgresql://u:pw@127.0.0.1:1/db",
            "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.bootstrap,
        },
    )
    assert result.returncode == 2, result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.anyio
async def test_replay_gives_up_on_an_unreachable_kafka_with_one_line(db_dsn: str) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            "INSERT INTO outbox (topic, payload, published_at) VALUES ('orders', '1', now())"
        )
        before = await _rows_state(db_dsn)
    finally:
        await conn.close()
    result = await areplay(
        "--topic",
        "orders",
        "--since",
        "1h",
        env={
            "NOTIFY_OUTBOX_DSN": db_dsn,
            "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
            "NOTIFY_OUTBOX_KAFKA_SEND_TIMEOUT": "1",
        },
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "notify-outbox: cannot reach Kafka at 127.0.0.1:1 within 1s "
        "(NOTIFY_OUTBOX_KAFKA_SEND_TIMEOUT)"
    )
    assert len(result.stderr.splitlines()) < 10, "aiokafka's retries are rate-limited"
    assert await _rows_state(db_dsn) == before


@pytest.mark.anyio
async def test_replay_stops_at_a_row_kafka_refuses_and_says_which(
    db_dsn: str, services: Services
) -> None:
    """A topic deleted since: the first batch fails, nothing after it is sent, exit 1."""
    gone = "gone-topic-never-created"
    conn = await asyncpg.connect(db_dsn)
    try:
        first = await conn.fetchval(
            "INSERT INTO outbox (topic, payload, published_at) "
            "SELECT $1, '1', now() FROM generate_series(1, 3) RETURNING id",
            gone,
        )
    finally:
        await conn.close()
    result = await areplay(
        "--topic",
        gone,
        "--since",
        "1h",
        env={
            "NOTIFY_OUTBOX_DSN": db_dsn,
            "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.bootstrap,
        },
    )
    assert result.returncode == 1, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("replay stopped: 0 of 3 rows of topic gone-topic-never-created ")
    assert f"row {first} was not: topic 'gone-topic-never-created' does not exist" in last
