"""Monitoring under a Kafka outage: /livez and /readyz of a relay process, and a real
Prometheus server scraping its /metrics every second while events flow, while Kafka is down
and after it is back (issue #12).

Prometheus comes from Debian's ``prometheus`` package (devstack/prometheus.py installs it when
missing). These tests stop the session's own Kafka, like the rest of the fault suite.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
import yaml

from tests.conftest import Services
from tests.faults.harness import (
    FaultRelay,
    KafkaTail,
    connect,
    eventually,
    relays,
    restartable,
    run_blocking,
    task_group,
)
from tests.faults.test_exactly_once import _eos_env
from tests.support import ROOT

pytestmark = pytest.mark.anyio

RULES = ROOT / "deploy" / "prometheus" / "notify-outbox-alerts.yml"
OLDEST_ALERT = "NotifyOutboxOldestPendingTooOld"


def _free_port() -> int:
    from devstack._common import free_ports

    return free_ports(1)[0]


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310
            return int(r.status), json.load(r)
    except urllib.error.HTTPError as e:
        return int(e.code), json.load(e)


async def get(url: str) -> tuple[int, dict[str, Any]]:
    return await anyio.to_thread.run_sync(lambda: _get(url))


def _monitored_relay(
    db_dsn: str, bootstrap: str, env: dict[str, str] | None = None
) -> tuple[FaultRelay, int]:
    port = _free_port()
    relay = FaultRelay(db_dsn, bootstrap, env={**(env or {}), "NOTIFY_OUTBOX_HTTP_PORT": str(port)})
    return relay, port


@contextlib.asynccontextmanager
async def producing(
    dsn: str, topic: str, *, every: float = 0.05, ids: list[str] | None = None
) -> AsyncIterator[list[int]]:
    """Insert one event every ``every`` seconds in the background (counting them, and noting
    their event ids in ``ids`` if given) until the block ends; errors of the producer fail the
    test."""
    produced = [0]
    conn = await asyncpg.connect(dsn)
    try:
        async with task_group() as tg:

            async def run() -> None:
                while True:
                    event_id = await conn.fetchval(
                        "INSERT INTO outbox (topic, key, payload) VALUES ($1, $2, '{}') "
                        "RETURNING event_id::text",
                        topic,
                        f"k{produced[0] % 7}",
                    )
                    produced[0] += 1
                    if ids is not None:
                        ids.append(event_id)
                    await anyio.sleep(every)  # pacing the load, not synchronisation

            tg.start_soon(run)
            yield produced
            tg.cancel_scope.cancel()
    finally:
        await conn.close()


@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
async def test_readyz_says_503_with_the_reason_while_kafka_is_down(
    db_dsn: str, services: Services, topic: str, delivery: str
) -> None:
    _, kafka = restartable(services)
    env: dict[str, str] = {}
    if delivery == "exactly-once":
        async with connect(db_dsn) as conn:
            await conn.execute("UPDATE outbox_config SET delivery = 'exactly-once'")
        env = _eos_env()
    relay, port = _monitored_relay(db_dsn, services.bootstrap, env)
    base = f"http://127.0.0.1:{port}"
    async with relays(relay), KafkaTail(services.bootstrap, [topic]) as tail:
        await relay.ready()
        status, body = await get(base + "/livez")
        assert (status, body["status"]) == (200, "alive"), body
        status, body = await get(base + "/readyz")
        assert (status, body["status"]) == (200, "ready"), body
        assert body["checks"]["listener"] == "ok"
        assert _healthcheck(port).returncode == 0

        await run_blocking(kafka.stop)
        inserted: list[str] = []
        async with producing(db_dsn, topic, every=0.2, ids=inserted):

            async def not_ready() -> bool:
                return (await get(base + "/readyz"))[0] == 503

            await eventually(not_ready, within=60, what="/readyz answers 503 with Kafka down")
            status, body = await get(base + "/readyz")
            assert body["status"] == "not ready"
            assert body["reason"] == "kafka: unavailable (does not answer)", body
            assert body["checks"]["database"] == "ok"
            # The event loop stays responsive through the outage.
            assert (await get(base + "/livez"))[0] == 200
            probe = _healthcheck(port)
            assert probe.returncode == 1
            assert "kafka: unavailable" in probe.stdout

            during_outage = len(inserted)
            await run_blocking(kafka.start)

            async def ready() -> bool:
                return (await get(base + "/readyz"))[0] == 200

            await eventually(
                ready, within=60, what="/readyz answers 200 again after Kafka's return"
            )
        assert _healthcheck(port).returncode == 0
        # Everything inserted during the outage arrives (and what was inserted after it).
        await eventually(
            lambda: _drained(db_dsn), within=60, what="the outage's backlog is drained"
        )
        assert during_outage > 0, "nothing was inserted during the outage"
        await tail.wait_for(inserted, within=60, what="every event inserted during the outage")
        await relay.stop_ok()


def _healthcheck(port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "notify_outbox", "healthcheck", "--timeout", "5"],
        env={"PYTHONPATH": str(ROOT), "NOTIFY_OUTBOX_HTTP_PORT": str(port), "PATH": "/usr/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def _drained(dsn: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
    finally:
        await conn.close()


def _test_rules(folder: Path) -> Path:
    """The shipped rules file with the oldest-pending alert at 3 s instead of 5 min (and no
    ``for``), so that the test sees the shipped expression fire."""
    rules = yaml.safe_load(RULES.read_text())
    found = False
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == OLDEST_ALERT:
                assert rule["expr"].endswith("> 300"), rule["expr"]
                rule["expr"] = rule["expr"].removesuffix("> 300") + "> 3"
                rule["for"] = "0s"
                found = True
    assert found, f"{OLDEST_ALERT} is not in {RULES}"
    path = folder / "notify-outbox-alerts.yml"
    path.write_text(yaml.safe_dump(rules))
    return path


async def test_prometheus_sees_the_series_move_through_a_kafka_outage(
    db_dsn: str, services: Services, topic: str, tmp_path: Path
) -> None:
    from devstack import StackError
    from devstack.prometheus import PrometheusServer

    _, kafka = restartable(services)
    relay, port = _monitored_relay(db_dsn, services.bootstrap)
    prometheus = PrometheusServer(
        tmp_path / "prometheus", [f"127.0.0.1:{port}"], rules=[_test_rules(tmp_path)]
    )
    try:
        await run_blocking(prometheus.start)
    except StackError as e:
        pytest.fail(f"no Prometheus server for this test: {e}", pytrace=False)

    async def value(promql: str) -> float | None:
        return await run_blocking(lambda: prometheus.value(promql))  # type: ignore[no-any-return]

    async def holds(promql: str, test: Callable[[float], bool]) -> bool:
        v = await value(promql)
        return v is not None and test(v)

    async def firing() -> set[str]:
        alerts = await run_blocking(prometheus.alerts)
        return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}

    published = "sum(notify_outbox_published_total)"
    pending = "max(notify_outbox_pending_events)"
    kafka_up = 'min(notify_outbox_up{component="kafka"})'
    try:
        async with relays(relay):
            await relay.ready()
            async with producing(db_dsn, topic) as produced:
                # Events flow: Prometheus sees published_total grow, twice.
                await eventually(
                    lambda: holds(published, lambda v: v >= 20),
                    within=60,
                    what="Prometheus sees events published",
                    interval=0.5,
                )
                first = await value(published)
                assert first is not None
                await eventually(
                    lambda: holds(published, lambda v: v > first + 20),
                    within=60,
                    what="published_total keeps growing while events flow",
                    interval=0.5,
                )
                assert await value(kafka_up) == 1
                assert OLDEST_ALERT not in await firing()

                # Kafka goes away while the application keeps writing.
                await run_blocking(kafka.stop)
                await eventually(
                    lambda: holds(kafka_up, lambda v: v == 0),
                    within=60,
                    what='notify_outbox_up{component="kafka"} goes to 0',
                    interval=0.5,
                )
                await eventually(
                    lambda: holds(pending, lambda v: v >= 20),
                    within=60,
                    what="pending events grow during the outage",
                    interval=0.5,
                )
                low = await value(pending)
                assert low is not None
                await eventually(
                    lambda: holds(pending, lambda v: v > low + 20),
                    within=60,
                    what="pending events keep growing during the outage",
                    interval=0.5,
                )
                await eventually(
                    lambda: _in(OLDEST_ALERT, firing),
                    within=60,
                    what=f"{OLDEST_ALERT} (3 s threshold) fires",
                    interval=0.5,
                )
                during = await value(published)

                # Kafka is back: the backlog drains, the alert resolves.
                await run_blocking(kafka.start)
                await eventually(
                    lambda: holds(kafka_up, lambda v: v == 1),
                    within=90,
                    what="notify_outbox_up{kafka} back to 1",
                    interval=0.5,
                )
            total = produced[0]
            await eventually(
                lambda: holds(published, lambda v: v >= total),
                within=90,
                what=f"published_total reaches the {total} events produced",
                interval=0.5,
            )
            await eventually(
                lambda: holds(pending, lambda v: v == 0),
                within=60,
                what="pending back to 0",
                interval=0.5,
            )
            await eventually(
                lambda: _not_in(OLDEST_ALERT, firing),
                within=60,
                what=f"{OLDEST_ALERT} resolves",
                interval=0.5,
            )
            assert during is not None
            assert (await value(published) or 0) > during
            # The outage is not mistaken for failing rows.
            assert await value("sum(notify_outbox_retries_total)") is None
            await relay.stop_ok()
    finally:
        await run_blocking(prometheus.stop)


async def _in(name: str, firing: Callable[[], Any]) -> bool:
    return name in await firing()


async def _not_in(name: str, firing: Callable[[], Any]) -> bool:
    return name not in await firing()
