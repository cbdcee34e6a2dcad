"""Operations of the exactly-once relay against real PostgreSQL and Kafka (issue #35, item 6):
its metrics (transactions, fences, leases, recoveries, the slots it holds), ``/readyz`` while a
batch in flight is settled from the markers, and the log lines of a fence and a recovery."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request

import asyncpg
import pytest
from prometheus_client import CollectorRegistry

from notify_outbox.ops.http import MonitoringServer
from notify_outbox.ops.metrics import RelayMetrics
from notify_outbox.relay.exactly_once import ExactlyOnceRelay
from tests.conftest import Services
from tests.faults.harness import eventually
from tests.integration.test_exactly_once import (
    READ_COMMITTED,
    _insert,
    _set_delivery,
    eos_settings,
    stamp_and_vanish,
)
from tests.support import consume

pytestmark = pytest.mark.anyio

TABLE = {"table": "public.outbox"}


def _get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 (loopback)
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def test_metrics_and_readyz_of_an_exactly_once_relay(
    db_dsn: str, services: Services, topic: str
) -> None:
    await _set_delivery(db_dsn, "exactly-once")
    registry = CollectorRegistry()
    relay = ExactlyOnceRelay(eos_settings(db_dsn, services, workers=2, eos_slots=4))
    # Attached before the relay starts: its leases and fences at start are counted.
    async with RelayMetrics(relay, registry=registry, stats_interval=0.2) as metrics, relay:
        server = MonitoringServer(metrics, "127.0.0.1", 0)
        await server.start()
        try:
            await _insert(db_dsn, topic, [f"k{i % 5}" for i in range(20)])
            await consume(services.bootstrap, topic, expect=20, within=60, client=READ_COMMITTED)

            def value(name: str, **labels: str) -> float:
                return registry.get_sample_value(name, {**TABLE, **labels}) or 0.0

            async def published() -> bool:
                return value("notify_outbox_published_total", topic=topic) == 20

            await eventually(published, within=30, what="20 rows counted as published")
            committed = value("notify_outbox_transactions_total", outcome="committed")
            assert committed == relay.counters["committed"] >= 1
            assert value("notify_outbox_transactions_total", outcome="aborted") == 0
            # Each worker leased a slot and started its producer (which fences any earlier).
            assert value("notify_outbox_slot_leases_total") == relay.counters["leases"] >= 2
            assert value("notify_outbox_fences_total") == relay.counters["fences"] >= 2
            assert value("notify_outbox_eos_slots_held") == 2
            assert value("notify_outbox_eos_slots_recovering") == 0
            assert value("notify_outbox_commit_to_ack_seconds_count") == 20
            for component in ("database", "kafka", "listener"):
                assert value("notify_outbox_up", component=component) == 1, component
            # The at-least-once relay's own gauges are not exported for this one.
            assert registry.get_sample_value("notify_outbox_awake", TABLE) is None

            status, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{server.port}/readyz")
            assert status == 200, body
            assert body["checks"] == {
                "relay": "ok",
                "database": "ok",
                "kafka": "ok",
                "listener": "ok",
                "slots": "ok",
            }
        finally:
            await server.close()


async def test_readyz_says_recovering_while_a_batch_in_flight_is_settled(
    db_dsn: str,
    services: Services,
    topic: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A slot left by a relay that vanished with a stamped batch: whoever takes it reads the
    markers first. Meanwhile the relay is not ready and says which slot it is settling; then
    the recovery is counted, logged, and the batch goes out once."""
    caplog.set_level(logging.INFO, logger="notify_outbox.exactly_once")
    await _set_delivery(db_dsn, "exactly-once")
    await _insert(db_dsn, topic, ["a", "b", "c"])
    conn = await asyncpg.connect(db_dsn)
    try:
        stamped = await stamp_and_vanish(conn, 1)
        assert len(stamped) == 3
        seq = stamped[0]["seq"]
    finally:
        await conn.close()
    registry = CollectorRegistry()
    relay = ExactlyOnceRelay(eos_settings(db_dsn, services, eos_lease=1.0, eos_slots=2))
    reading = asyncio.Event()
    release = asyncio.Event()
    read_markers = relay._committed_seq

    async def held_read(slot: int) -> int:
        reading.set()
        await release.wait()
        return await read_markers(slot)

    monkeypatch.setattr(relay, "_committed_seq", held_read)
    metrics = RelayMetrics(relay, registry=registry)
    async with relay:
        await asyncio.wait_for(reading.wait(), 30)
        readiness = metrics.readiness()
        assert not readiness.ready
        assert readiness.checks["slots"].startswith("recovering slot 1"), readiness.checks
        assert registry.get_sample_value("notify_outbox_eos_slots_recovering", TABLE) == 1
        release.set()
        records, _ = await consume(
            services.bootstrap, topic, expect=3, within=60, client=READ_COMMITTED
        )

        async def ready() -> bool:
            return metrics.readiness().ready

        await eventually(ready, within=30, what="ready once the batch was settled")
    assert len(records) == 3
    recovered = registry.get_sample_value(
        "notify_outbox_recoveries_total", {**TABLE, "outcome": "aborted"}
    )
    assert recovered == 1
    assert registry.get_sample_value("notify_outbox_eos_slots_recovering", TABLE) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        f"slot 1: batch {seq} was in flight" in m and "did not commit" in m for m in messages
    )
    assert any(
        "slot 1: producer" in m and "earlier producer of the slot is fenced" in m for m in messages
    ), messages
