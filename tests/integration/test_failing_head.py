"""A failing head (migration 0006) against real PostgreSQL and Kafka: thousands of rows of a
few keys that cannot be published sit at the head of the queue, and the rows of other keys
still flow; the failing keys keep their order and their retry schedule, and the relay does not
spin on empty claims meanwhile."""

from __future__ import annotations

import json
import uuid
from collections import defaultdict

import anyio
import asyncpg
import pytest

from notify_outbox import Relay
from notify_outbox.core.events import RelayEvents
from notify_outbox.core.names import OutboxNames
from notify_outbox.pg.store import claim_scan
from tests.conftest import Services
from tests.integration.test_claim_buckets import BATCH, _claim
from tests.integration.test_relay import make_settings
from tests.support import consume, create_topics, header, topic_total

pytestmark = pytest.mark.anyio

FAILING_KEYS = 5


async def _one_key(conn: asyncpg.Connection, topic: str, rows: int) -> None:
    """``rows`` rows of key k to ``topic``, payloads {"n": 1} to {"n": rows}."""
    await conn.execute(
        "INSERT INTO outbox (topic, key, payload) "
        "SELECT $1, 'k', jsonb_build_object('n', g) FROM generate_series(1, $2::int) g",
        topic,
        rows,
    )


async def _parked(conn: asyncpg.Connection, events: RelayEvents, *, at_least: int) -> int:
    """Wait until ``at_least`` rows are parked (their key's earlier row failed), and return
    how many are. Rows are parked by claims: the count is read again after each event of the
    relay, not on a timer."""
    while True:
        seen = events.seen
        parked: int = await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE next_attempt_at = 'infinity'"
        )
        if parked >= at_least:
            return parked
        await events.wait_after(seen)


async def test_healthy_keys_flow_past_thousands_of_failing_rows(
    db_dsn: str, services: Services, topic: str
) -> None:
    missing = f"missing-{uuid.uuid4().hex[:12]}"  # auto-creation is off on the test broker
    settings = make_settings(
        db_dsn, services, workers=4, retry_base_delay=1.0, retry_max_delay=4.0, max_attempts=100
    )
    conn = await asyncpg.connect(db_dsn)
    try:
        # 5,000 rows of 5 keys at the head of the queue, to a topic that does not exist.
        await conn.execute(
            "INSERT INTO outbox (topic, key, payload) "
            "SELECT $1, 'f' || (g % $2), jsonb_build_object('n', g) "
            "FROM generate_series(1, 5000) g",
            missing,
            FAILING_KEYS,
        )
        async with Relay(settings) as relay:
            events = relay.events
            with anyio.fail_after(60):
                await events.wait_for("retried", FAILING_KEYS)  # each key's first row failed
            # Then rows of other keys, to a healthy topic: none waits for the failing ones.
            await conn.execute(
                "INSERT INTO outbox (topic, key, payload) "
                "SELECT $1, 'h' || (g % 30), jsonb_build_object('n', g) "
                "FROM generate_series(1, 300) g",
                topic,
            )
            healthy, total = await consume(services.bootstrap, topic, expect=300, within=60)
            assert total == 300
            # The failing keys' later rows step aside: parked behind their first row, a chunk
            # per claim, and the healthy rows need not wait for all of them.
            with anyio.fail_after(30):
                held_back = await _parked(conn, events, at_least=5000 - FAILING_KEYS)
            assert held_back == 5000 - FAILING_KEYS
            with anyio.fail_after(30):
                await events.wait_for("published", 300)

            # The topic appears: at their next retry the failing keys drain, each in order.
            await create_topics(services.bootstrap, [missing], partitions=3)
            drained, total = await consume(services.bootstrap, missing, expect=5000, within=120)
            assert total == 5000
            with anyio.fail_after(30):
                await events.wait_for("published", 5300)
            # Retries came on their schedule, not in a loop: a few per key. And no claim spun
            # empty while the failing rows waited (a loop would make thousands).
            assert events.counts["retried"] < FAILING_KEYS * 12
            assert events.counts["claimed_none"] < 50, dict(events.counts)
        # Counted again once the relay stopped: no late copy of either topic's rows.
        assert await topic_total(services.bootstrap, topic) == 300
        assert await topic_total(services.bootstrap, missing) == 5000
    finally:
        await conn.close()

    by_key: dict[bytes | None, list[int]] = defaultdict(list)
    for record in sorted(drained, key=lambda r: (r.partition, r.offset)):
        by_key[record.key].append(json.loads(record.value)["n"])
    assert len(by_key) == FAILING_KEYS
    for key, numbers in by_key.items():
        assert numbers == sorted(numbers), f"key {key!r} out of order"
        assert len(numbers) == len(set(numbers)) == 1000
    assert all(header(r, "outbox-event-id") for r in healthy)


async def test_a_dead_lettered_row_lets_its_parked_key_go_on(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Every row of a key fails at once (its topic does not exist, one attempt allowed): each
    is dead-lettered in turn, and each dead letter promotes the key's next parked row, so the
    key never sticks (the fallback poll, which would also release it, is 30 s away)."""
    missing = f"missing-{uuid.uuid4().hex[:12]}"
    settings = make_settings(db_dsn, services, workers=2, max_attempts=1)
    conn = await asyncpg.connect(db_dsn)
    try:
        await _one_key(conn, missing, 30)
        async with Relay(settings) as relay:
            with anyio.fail_after(20):
                await relay.events.wait_for("dead_lettered", 30)
        ordered = await conn.fetch("SELECT payload->>'n' AS n FROM outbox_dead_letter ORDER BY id")
    finally:
        await conn.close()
    assert [int(r["n"]) for r in ordered] == list(range(1, 31))


async def test_the_fallback_poll_releases_a_key_whose_failed_row_was_deleted(
    db_dsn: str, services: Services, topic: str
) -> None:
    """A key's failed row deleted by hand (or published by a relay of migration 0005) promotes
    nothing: its parked rows are first of their key, and the fallback poll promotes them."""
    missing = f"missing-{uuid.uuid4().hex[:12]}"
    settings = make_settings(db_dsn, services, workers=2, poll_interval=0.5, retry_base_delay=60)
    conn = await asyncpg.connect(db_dsn)
    try:
        await _one_key(conn, missing, 50)
        async with Relay(settings) as relay:
            with anyio.fail_after(30):
                await relay.events.wait_for("retried", 1)
                while (
                    await conn.fetchval(
                        "SELECT count(*) FROM outbox WHERE next_attempt_at = 'infinity'"
                    )
                    < 49
                ):
                    await relay.events.wait_for("poll", relay.events.counts["poll"] + 1)
            await create_topics(services.bootstrap, [missing], partitions=3)
            await conn.execute("DELETE FROM outbox WHERE next_attempt_at < 'infinity'")
            records, _ = await consume(services.bootstrap, missing, expect=49, within=30)
        total = await topic_total(services.bootstrap, missing)  # the relay stopped
    finally:
        await conn.close()
    assert total == 49
    assert [json.loads(r.value or b"")["n"] for r in records] == list(range(2, 51))


async def test_a_key_sharing_its_bucket_with_a_failing_key_is_claimed_at_once(
    db_dsn: str,
) -> None:
    """Claims park a failing key's rows a chunk at a time; a healthy key whose rows hash to the
    same bucket, behind 20,000 of them, is claimed by the next claim all the same, in order,
    and while the failing key's rows are still being parked (the claim reads the bucket's
    other keys past the held ones)."""
    conn = await asyncpg.connect(db_dsn)
    try:
        twin = await conn.fetchval(
            "SELECT 'h' || g FROM generate_series(1, 100000) g "
            "WHERE hashtext('h' || g) & 255 = hashtext($1::text) & 255 LIMIT 1",
            "f0",
        )
        assert twin is not None
        await conn.execute(
            "INSERT INTO outbox (topic, key) SELECT 'missing', 'f0' FROM generate_series(1, 20000)"
        )
        await conn.execute("VACUUM ANALYZE outbox")
        first = await conn.fetchval("SELECT min(id) FROM outbox")
        # The failing key's first row failed: it waits for a retry far away.
        await conn.execute(
            "UPDATE outbox SET attempts = 1, next_attempt_at = now() + interval '1 hour' "
            "WHERE id = $1",
            first,
        )
        await conn.execute(
            "INSERT INTO outbox (topic, key) SELECT 'ok', $1 FROM generate_series(1, 30)", twin
        )
        twin_ids = [
            r["id"]
            for r in await conn.fetch("SELECT id FROM outbox WHERE key = $1 ORDER BY id", twin)
        ]
        async with conn.transaction():
            rows = await _claim(conn)
        assert len(twin_ids) < BATCH
        assert [r["id"] for r in rows] == twin_ids
        parked = await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE next_attempt_at = 'infinity'"
        )
        # Parking goes on a chunk per claim: this claim did part of it, not all.
        assert 0 < parked < 20000 - 1, parked
    finally:
        await conn.close()


async def test_two_claims_at_a_time_park_and_the_others_take_healthy_rows_at_once(
    db_dsn: str,
) -> None:
    """While two claims park a failing head (they hold the two parking locks), another claim
    parks nothing and walks no held bucket, but takes the healthy rows of other buckets at
    once. With a parking lock free, the next claim parks a chunk, and takes the rows of a key
    that shares a failing key's bucket too (it walks every held bucket)."""
    namespace = OutboxNames().claim_namespace
    conn = await asyncpg.connect(db_dsn)
    parker = await asyncpg.connect(db_dsn)
    try:
        # Two failing keys, interleaved; five healthy keys in buckets of their own; and a
        # twin: a healthy key in f0's bucket.
        failing = ["f0", "f1"]
        buckets = "SELECT hashtext(k) & 255 FROM unnest($1::text[]) AS k"
        others = await conn.fetch(
            f"SELECT 'h' || g AS k FROM generate_series(1, 1000) g "
            f"WHERE hashtext('h' || g) & 255 NOT IN ({buckets}) LIMIT 5",
            failing,
        )
        twin = await conn.fetchval(
            "SELECT 'h' || g FROM generate_series(1, 100000) g "
            "WHERE hashtext('h' || g) & 255 = hashtext('f0') & 255 LIMIT 1"
        )
        await conn.execute(
            "INSERT INTO outbox (topic, key) "
            "SELECT 'missing', 'f' || (g % 2) FROM generate_series(1, 4000) g"
        )
        await conn.execute(
            "UPDATE outbox SET attempts = 1, next_attempt_at = now() + interval '1 hour' "
            "WHERE id IN (SELECT min(id) FROM outbox GROUP BY key)"
        )
        await conn.execute(
            "INSERT INTO outbox (topic, key) SELECT 'ok', k "
            "FROM unnest($1::text[]) AS k, generate_series(1, 5)",
            [r["k"] for r in others],
        )
        await conn.execute(
            "INSERT INTO outbox (topic, key) SELECT 'ok', $1 FROM generate_series(1, 5)", twin
        )
        healthy = {
            r["id"]
            for r in await conn.fetch(
                "SELECT id FROM outbox WHERE topic = 'ok' AND key <> $1", twin
            )
        }
        twins = {r["id"] for r in await conn.fetch("SELECT id FROM outbox WHERE key = $1", twin)}
        assert len(healthy) == 25
        assert len(twins) == 5
        await conn.execute("VACUUM ANALYZE outbox")

        async def parked() -> int:
            n: int = await conn.fetchval(
                "SELECT count(*) FROM outbox WHERE next_attempt_at = 'infinity'"
            )
            return n

        async def claim() -> set[int]:
            async with conn.transaction():  # nothing published: the rows stay pending
                return {r["id"] for r in await _claim(conn)}

        async with parker.transaction():
            await parker.execute(
                "SELECT pg_advisory_xact_lock($1, 256), pg_advisory_xact_lock($1, 257)",
                namespace,
            )
            assert await claim() == healthy  # not the twin: its bucket was not walked
            assert await parked() == 0, "a claim parked while two others held the parking locks"
        async with parker.transaction():
            # One parking lock taken: this claim is the second parker. It walks every held
            # bucket (the twin's rows), and parks a chunk.
            await parker.execute("SELECT pg_advisory_xact_lock($1, 256)", namespace)
            assert await claim() == healthy | twins
            assert 0 < await parked() <= claim_scan(BATCH) // 2
    finally:
        await parker.close()
        await conn.close()


@pytest.mark.parametrize("keep_published", [0, 3600])
async def test_a_published_retry_lets_its_parked_key_go_on(
    db_dsn: str, services: Services, keep_published: float
) -> None:
    """A key's first row fails (its topic is missing), its later rows are parked behind it; the
    topic appears, the retry is published, and the published retry promotes the key's next
    parked row at once: the rest follows within seconds, not at the fallback poll (30 s).
    (It waited for the poll: the published row, marked later in the same transaction, was
    taken for its key's first waiting row.)"""
    missing = f"missing-{uuid.uuid4().hex[:12]}"
    settings = make_settings(
        db_dsn, services, workers=2, retry_base_delay=0.5, keep_published=keep_published
    )
    conn = await asyncpg.connect(db_dsn)
    try:
        await _one_key(conn, missing, 20)
        async with Relay(settings) as relay:
            with anyio.fail_after(20):
                await relay.events.wait_for("retried", 1)
                await _parked(conn, relay.events, at_least=19)
            await create_topics(services.bootstrap, [missing], partitions=3)
            records, _ = await consume(services.bootstrap, missing, expect=20, within=10)
        assert relay.events.counts["wake:poll"] == 0
        total = await topic_total(services.bootstrap, missing)  # the relay stopped
    finally:
        await conn.close()
    assert total == 20
    assert [json.loads(r.value or b"")["n"] for r in records] == list(range(1, 21))
