"""The relay's Prometheus metrics and its monitoring server (/metrics, /livez, /readyz), and
``notify-outbox healthcheck``, against the in-memory fakes: no database, no Kafka."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from notify_outbox import OutboxSettings, Relay
from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.message import SCHEMA_REGISTRY
from notify_outbox.ops.http import MonitoringServer, healthcheck
from notify_outbox.ops.metrics import OTHER_TOPIC, OutboxStats, RelayMetrics, failure_class
from tests.fakes import FakePublisher, FakeStore, fake_settings
from tests.support import ROOT

pytestmark = pytest.mark.anyio

TABLE = "public.outbox"


def settings(**kw: object) -> OutboxSettings:
    return fake_settings(**{"max_attempts": 2, **kw})


def samples(metrics: RelayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the registry: (name, sorted labels) -> value."""
    from prometheus_client import generate_latest

    found = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def value(metrics: RelayMetrics, name: str, **labels: str) -> float | None:
    key = (name, tuple(sorted({"table": TABLE, **labels}.items())))
    return samples(metrics).get(key)


async def drained(store: FakeStore, relay: Relay) -> None:
    with anyio.fail_after(10):
        while store.pending():
            await relay.events.wait_for("batch_done", relay.events.counts["batch_done"] + 1)


async def test_counters_by_topic_and_reason_and_commit_to_ack() -> None:
    store = FakeStore()
    created = datetime.now(UTC) - timedelta(seconds=2)
    for topic in ("orders", "orders", "payments"):
        row_id = store.add(topic=topic)
        store.rows[row_id].row = replace(store.rows[row_id].row, created_at=created)
    missing = store.add(topic="nope")
    malformed = store.add(topic="orders")

    def behaviour(row: object) -> tuple[str, str] | None:
        row_id = row.id  # type: ignore[attr-defined]
        if row_id == missing:
            return ("fail", "topic 'nope' does not exist in Kafka")
        if row_id == malformed:
            return ("reject", "malformed event: headers")
        return None

    relay = Relay(settings(), store=store, publisher=FakePublisher(behaviour))
    metrics = RelayMetrics(relay)
    async with relay:
        await drained(store, relay)
    assert value(metrics, "notify_outbox_published_total", topic="orders") == 2
    assert value(metrics, "notify_outbox_published_total", topic="payments") == 1
    # max_attempts=2: one retry, then dead-lettered.
    assert value(metrics, "notify_outbox_retries_total", topic="nope") == 1
    assert value(metrics, "notify_outbox_dead_lettered_total", topic="nope") == 1
    assert value(metrics, "notify_outbox_dead_lettered_total", topic="orders") == 1
    assert value(metrics, "notify_outbox_publish_failures_total", reason="topic_missing") == 2
    assert value(metrics, "notify_outbox_publish_failures_total", reason="malformed") == 1
    # Every reason class exists from the start, at 0, so that increase() sees a first failure.
    assert value(metrics, "notify_outbox_publish_failures_total", reason="database") == 0
    # Only the rows with a created_at are observed; about 2 s each.
    assert value(metrics, "notify_outbox_commit_to_ack_seconds_count") == 3
    total = value(metrics, "notify_outbox_commit_to_ack_seconds_sum")
    assert total is not None
    assert 6 <= total < 15
    assert value(metrics, "notify_outbox_commit_to_ack_seconds_bucket", le="1.0") == 0
    assert value(metrics, "notify_outbox_wakeups_total", source="start") == 1
    assert (value(metrics, "notify_outbox_claim_batch_size_count") or 0) >= 1


async def test_topic_labels_are_bounded() -> None:
    store = FakeStore()
    for n in range(5):
        store.add(topic=f"topic-{n}")
    relay = Relay(settings(batch_size=1, workers=1), store=store, publisher=FakePublisher())
    metrics = RelayMetrics(relay, max_topics=2)
    async with relay:
        await drained(store, relay)
    topics = {
        dict(labels)["topic"]: v
        for (name, labels), v in samples(metrics).items()
        if name == "notify_outbox_published_total"
    }
    assert topics == {"topic-0": 1, "topic-1": 1, OTHER_TOPIC: 3}


def test_failure_classes() -> None:
    assert failure_class("topic 'x' does not exist in Kafka") == "topic_missing"
    assert failure_class("malformed event: bad headers") == "malformed"
    assert failure_class("MessageSizeTooLargeError: big") == "too_large"
    assert failure_class("TopicAuthorizationFailedError: no") == "not_authorized"
    assert failure_class("KafkaError: something") == "kafka_error"


async def test_kafka_unavailable_rows_count_as_failures_and_state_gauges() -> None:
    store = FakeStore()
    for _ in range(3):
        store.add(topic="orders")
    pub = FakePublisher(lambda _row: ("unavailable", "broker gone"))
    relay = Relay(settings(workers=1), store=store, publisher=pub)
    metrics = RelayMetrics(relay)
    async with relay:
        await relay.events.wait_for("kafka_unavailable")
        assert (value(metrics, "notify_outbox_publish_failures_total", reason="kafka_unavailable")
                or 0) >= 3  # fmt: skip
        pub.behaviour = lambda _row: None
        await drained(store, relay)
        assert value(metrics, "notify_outbox_up", component="kafka") == 1
        assert value(metrics, "notify_outbox_up", component="database") == 1
        # Poll-only: no listener series at all.
        assert value(metrics, "notify_outbox_up", component="listener") is None
        assert value(metrics, "notify_outbox_awake") == 0


async def test_a_schema_registry_outage_is_named_in_the_log_readiness_and_gauges(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rows that wait for the Schema Registry (their schemas could not be loaded): the
    outage's lines, ``/readyz`` and ``notify_outbox_up`` name the registry, not Kafka."""
    store = FakeStore()
    pub = FakePublisher()
    pub.dependency = SCHEMA_REGISTRY

    def registry_down(_row: object) -> tuple[str, str]:
        pub.available = False  # as KafkaPublisher: unavailable until wait_available returns
        return ("unavailable", "Schema Registry at http://registry unreachable (refused)")

    pub.behaviour = registry_down
    url = "http://registry:8081"
    relay = Relay(settings(workers=1, schema_registry_url=url), store=store, publisher=pub)
    metrics = RelayMetrics(relay)
    with caplog.at_level(logging.WARNING, logger="notify_outbox.relay"):
        async with relay:
            assert metrics.readiness().checks["schema_registry"] == "ok"
            # The row comes once the relay is seen ready: its first claim may publish at once.
            store.add(topic="orders")
            relay.wake()
            await relay.events.wait_for("kafka_unavailable")
            down = metrics.readiness()
            assert not down.ready
            assert down.reason == "schema_registry: unavailable (does not answer)"
            assert down.checks["kafka"] == "ok"
            assert value(metrics, "notify_outbox_up", component="schema_registry") == 0
            assert value(metrics, "notify_outbox_up", component="kafka") == 1
            pub.behaviour = lambda _row: None
            pub.back()
            await drained(store, relay)
            assert metrics.readiness().ready
            assert value(metrics, "notify_outbox_up", component="schema_registry") == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "notify_outbox.relay"]
    outage = [line for line in lines if "unavailable" in line or "available again" in line]
    assert outage[0] == (
        "Schema Registry unavailable (Schema Registry at http://registry unreachable "
        "(refused)); rows stay pending"
    )
    assert outage[1].startswith("Schema Registry available again after ")
    assert len(outage) == 2


async def test_readiness_follows_the_relay() -> None:
    store = FakeStore()
    relay = Relay(settings(), store=store, publisher=FakePublisher())
    metrics = RelayMetrics(relay)
    before = metrics.readiness()
    assert not before.ready
    assert "starting" in before.reason
    async with relay:
        ready = metrics.readiness()
        assert ready.ready, ready.reason
        assert ready.as_json() == {
            "status": "ready",
            "checks": {"relay": "ok", "database": "ok", "kafka": "ok", "listener": "poll-only"},
        }
        relay.kafka_outage.failed("test: broker gone")
        down = metrics.readiness()
        assert not down.ready
        assert down.as_json()["reason"] == "kafka: unavailable (does not answer)"
        relay.kafka_outage.recovered()
        relay.db_outage.failed("test: connection refused")
        assert metrics.readiness().reason == "database: unreachable"
        relay.db_outage.recovered()
        assert metrics.readiness().ready
    after = metrics.readiness()
    assert not after.ready
    assert after.checks["relay"] == "stopped (stopped)"


# --- the monitoring server -----------------------------------------------------------------


async def http_get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    with anyio.fail_after(10):
        raw = await reader.read()
    writer.close()
    head, _, body = raw.decode().partition("\r\n\r\n")
    status_line, *header_lines = head.split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, body


async def test_server_endpoints_and_bounded_stats_reads() -> None:
    reads = 0
    release = anyio.Event()

    async def stats() -> OutboxStats:
        nonlocal reads
        reads += 1
        await release.wait()
        return OutboxStats(pending=42, oldest_pending_seconds=7.5, dead_lettered=3)

    relay = Relay(settings(), store=FakeStore(), publisher=FakePublisher())
    metrics = RelayMetrics(relay, stats=stats, stats_interval=60)
    # Count the scrapes that reached the shared read (the server calls metrics.refresh()
    # for each /metrics request), so that the test knows when all three are waiting on it.
    refreshing = 0
    all_refreshing = anyio.Event()
    shared_refresh = metrics.refresh

    async def counted_refresh() -> None:
        nonlocal refreshing
        refreshing += 1
        if refreshing == 3:
            all_refreshing.set()
        await shared_refresh()

    metrics.refresh = counted_refresh  # type: ignore[method-assign]
    server = MonitoringServer(metrics, "127.0.0.1", 0)
    await server.start()
    metrics.start(refresh=False)
    try:
        status, _, body = await http_get(server.port, "/readyz")
        assert status == 503
        assert json.loads(body)["status"] == "not ready"
        async with relay:
            # Three scrapers at once share one read of the table gauges.
            async with anyio.create_task_group() as tg:
                results: list[tuple[int, dict[str, str], str]] = []

                async def scrape() -> None:
                    results.append(await http_get(server.port, "/metrics"))

                for _ in range(3):
                    tg.start_soon(scrape)
                with anyio.fail_after(30):
                    await all_refreshing.wait()  # all three wait while the read is held
                assert reads == 1
                release.set()
            assert reads == 1
            status, headers, text = results[0]
            assert status == 200
            assert headers["content-type"].startswith("text/plain")
            assert f'notify_outbox_pending_events{{table="{TABLE}"}} 42.0' in text
            assert f'notify_outbox_oldest_pending_age_seconds{{table="{TABLE}"}} 7.5' in text
            assert f'notify_outbox_dead_letter_events{{table="{TABLE}"}} 3.0' in text
            # Cached for stats_interval: a later scrape reads nothing.
            await http_get(server.port, "/metrics")
            assert reads == 1

            status, _, body = await http_get(server.port, "/readyz")
            assert status == 200, body
            assert json.loads(body)["status"] == "ready"
            status, _, body = await http_get(server.port, "/livez")
            assert status == 200
            assert json.loads(body)["status"] == "alive"
            status, _, body = await http_get(server.port, "/nope")
            assert status == 404
            status, _, _ = await http_get(server.port, "/metrics", method="POST")
            assert status == 405
            status, headers, body = await http_get(server.port, "/readyz", method="HEAD")
            assert status == 200
            assert body == ""
            assert int(headers["content-length"]) > 0

            # notify-outbox healthcheck, as an exec probe would run it.
            url = f"http://127.0.0.1:{server.port}/readyz"
            code, line = await anyio.to_thread.run_sync(lambda: healthcheck(url))
            assert code == 0
            assert json.loads(line)["status"] == "ready"
            relay.kafka_outage.failed("test")
            code, line = await anyio.to_thread.run_sync(lambda: healthcheck(url))
            assert code == 1
            assert "kafka: unavailable" in line
            relay.kafka_outage.recovered()
    finally:
        await server.close()
        await metrics.aclose()
    code, line = healthcheck(f"http://127.0.0.1:{server.port}/readyz", timeout=2)
    assert code == 1
    assert "no answer" in line


async def test_port_in_use_is_one_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        relay = Relay(settings(), store=FakeStore(), publisher=FakePublisher())
        server = MonitoringServer(RelayMetrics(relay), "127.0.0.1", port)
        with pytest.raises(ConfigurationError, match="address already in use"):
            await server.start()


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NOTIFY_OUTBOX_")}
    return subprocess.run(
        [sys.executable, "-m", "notify_outbox", *args],
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_cli_run_with_the_port_in_use_exits_2_with_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _cli(
            "run",
            NOTIFY_OUTBOX_DSN="postgresql://u:secret@127.0.0.1:1/db",
            NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1",
            NOTIFY_OUTBOX_HTTP_PORT=str(port),
        )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("notify-outbox:")]
    assert lines == [
        f"notify-outbox: cannot serve /metrics on 127.0.0.1:{port} "
        "(NOTIFY_OUTBOX_HTTP_HOST / NOTIFY_OUTBOX_HTTP_PORT): address already in use"
    ]
    assert "secret" not in done.stderr


def test_cli_healthcheck_without_a_port_or_server() -> None:
    done = _cli("healthcheck")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "notify-outbox: NOTIFY_OUTBOX_HTTP_PORT is not set: the relay serves /readyz only when "
        "it is (or pass --url)"
    )
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = _cli("healthcheck", "--timeout", "2", NOTIFY_OUTBOX_HTTP_PORT=str(port))
    assert done.returncode == 1
    assert done.stdout.startswith(
        f"notify-outbox: not ready: no answer from http://127.0.0.1:{port}"
    )


async def test_hooks_and_batch_observers_side_by_side() -> None:
    store = FakeStore()
    store.add(topic="orders")
    relay = Relay(settings(), store=store, publisher=FakePublisher())
    seen: list[tuple[str, int]] = []
    batches: list[tuple[list[int], list[int], str | None]] = []
    relay.events.add_hook(lambda name, n: seen.append((name, n)))
    relay.events.add_batch_observer(
        lambda rows, outcome, why: batches.append(([r.id for r in rows], outcome.published, why))
    )
    async with relay:
        await drained(store, relay)
    assert ("published", 1) in seen
    assert batches == [([1], [1], None)]
