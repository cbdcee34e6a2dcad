"""The metrics' SQL against a real PostgreSQL, and an embedded relay's metrics with real
PostgreSQL and Kafka: the bounded table gauges (pending, oldest, dead letters), the claim's
created_at, and the commit-to-ack histogram."""

from __future__ import annotations

from typing import Any

import anyio
import asyncpg
import pytest
from prometheus_client import CollectorRegistry

from notify_outbox import OutboxNames, OutboxSettings, Relay
from notify_outbox.ops.metrics import RelayMetrics
from notify_outbox.pg.sqlfiles import Queries
from notify_outbox.pg.store import LowWaterMark, PgOutboxStore
from tests.conftest import Services
from tests.faults.harness import eventually

pytestmark = pytest.mark.anyio


def make_settings(db_dsn: str, services: Services, **kw: Any) -> OutboxSettings:
    return OutboxSettings(
        dsn=db_dsn,  # type: ignore[arg-type]
        kafka_bootstrap_servers=services.bootstrap,
        workers=2,
        poll_interval=30.0,
        **kw,
    )


async def test_stats_query_counts_pending_waiting_and_dead_within_its_limit(db_dsn: str) -> None:
    q = Queries(OutboxNames())
    conn = await asyncpg.connect(db_dsn)
    try:
        start = LowWaterMark().args()  # a relay's mark before its first claim
        empty = await conn.fetchrow(q["metrics_stats"], 100, *start)
        assert dict(empty) == {"pending": 0, "oldest_pending_seconds": None, "dead_lettered": 0}
        # The oldest (smallest id) row is one waiting for a retry: it must be found too.
        await conn.execute(
            "INSERT INTO outbox (topic, created_at, attempts, next_attempt_at) "
            "VALUES ('t', now() - interval '90 seconds', 1, now() + interval '1 hour')"
        )
        await conn.execute(
            "INSERT INTO outbox (topic, created_at) "
            "SELECT 't', now() - interval '10 seconds' FROM generate_series(1, 5)"
        )
        await conn.execute("INSERT INTO outbox (topic, published_at) VALUES ('t', now())")
        await conn.execute(
            "INSERT INTO outbox_dead_letter (id, event_id, topic, created_at, attempts, error) "
            "SELECT g, gen_random_uuid(), 't', now(), 1, 'x' FROM generate_series(1000, 1002) g"
        )
        row = await conn.fetchrow(q["metrics_stats"], 100, *start)
        assert row["pending"] == 6
        assert 89 < row["oldest_pending_seconds"] < 120
        assert row["dead_lettered"] == 3
        # Bounded: each count stops at the limit.
        bounded = await conn.fetchrow(q["metrics_stats"], 2, *start)
        assert bounded["pending"] == 2 + 1  # fresh rows up to 2, plus the waiting one
        assert bounded["dead_lettered"] == 2
    finally:
        await conn.close()


async def test_claim_returns_created_at(db_dsn: str) -> None:
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=2)
    try:
        await pool.execute("INSERT INTO outbox (topic, key) VALUES ('t', 'a'), ('t', NULL)")
        store = PgOutboxStore(
            pool, Queries(OutboxNames()), delete_on_publish=True, command_timeout=10
        )
        async with store.claim(10) as batch:
            rows = list(batch.rows)
        assert [r.key for r in rows] == ["a", None]  # still in id order
        assert all(r.created_at is not None for r in rows)
        assert all(r.attempts == 0 for r in rows)
    finally:
        await pool.close()


async def test_embedded_relay_metrics_on_an_application_registry(
    db_dsn: str, services: Services, topic: str
) -> None:
    registry = CollectorRegistry()  # the application's own
    conn = await asyncpg.connect(db_dsn)
    try:
        async with (
            Relay(make_settings(db_dsn, services)) as relay,
            RelayMetrics(relay, registry=registry, stats_interval=0.2) as metrics,
        ):
            await conn.execute(
                f"INSERT INTO outbox (topic, key) SELECT '{topic}', 'k' || g "
                "FROM generate_series(1, 30) g"
            )
            with anyio.fail_after(30):
                while (
                    registry.get_sample_value(
                        "notify_outbox_published_total",
                        {"table": "public.outbox", "topic": topic},
                    )
                    or 0
                ) < 30:
                    await relay.events.wait_for("published", relay.events.counts["published"] + 1)

            # The background refresh reads the table gauges without any scrape.
            async def refreshed() -> bool:
                return metrics.stats is not None and metrics.stats.pending == 0

            await eventually(refreshed, within=30, what="the table gauges say 0 pending")
            labels = {"table": "public.outbox"}
            assert registry.get_sample_value("notify_outbox_pending_events", labels) == 0
            count = registry.get_sample_value("notify_outbox_commit_to_ack_seconds_count", labels)
            assert count == 30
            for component in ("database", "kafka", "listener"):
                value = registry.get_sample_value(
                    "notify_outbox_up", {**labels, "component": component}
                )
                assert value == 1, component
            assert metrics.readiness().ready
    finally:
        await conn.close()
