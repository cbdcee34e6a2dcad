"""One relay, many outboxes (issue #34): a ``Fleet`` serving a schema per tenant, against a real
PostgreSQL and Kafka. Each outbox's events arrive in per-key order; the database gets one
listening connection per channel and a pool bounded by settings; a tenant migrated while the
fleet runs is served without a restart, a dropped one let go; a tenant that cannot be served is
reported while the others deliver; the fallback poll finds rows no notification announced; the
Debezium-compatible mode works per tenant, and an inbox applies what it relays once."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from notify_outbox import Fleet, FleetDatabase, OutboxNames, OutboxSettings, migrate
from notify_outbox.debezium.capture import DebeziumCapture, install_capture, verify_capture
from notify_outbox.inbox import Inbox, migrate_inbox
from notify_outbox.ops.fleet_metrics import FleetMetrics
from notify_outbox.ops.http import MonitoringServer
from notify_outbox.pg.sqlfiles import load_migrations
from tests.conftest import Services
from tests.support import (
    RelayProcess,
    consume,
    create_topics,
    dsn_with_database,
    metric,
    topic_total,
)

pytestmark = pytest.mark.anyio

LATEST = max(m.version for m in load_migrations())


def new_database(services: Services) -> str:
    name = f"f_{uuid.uuid4().hex[:12]}"

    async def create() -> None:
        conn = await asyncpg.connect(services.dsn)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    anyio.run(create)
    return dsn_with_database(services.dsn, name)


def drop_database(services: Services, dsn: str) -> None:
    name = dsn.rsplit("/", 1)[1].split("?")[0]

    async def drop() -> None:
        conn = await asyncpg.connect(services.dsn)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    anyio.run(drop)


def settings(dsn: str, services: Services, **kw: Any) -> OutboxSettings:
    base: dict[str, Any] = {
        "dsn": dsn,
        "kafka_bootstrap_servers": services.bootstrap,
        "workers": 4,
        "poll_interval": 30.0,  # long: these tests must not pass thanks to the poll
    }
    base.update(kw)
    return OutboxSettings(**base)


async def insert(conn: asyncpg.Connection, schema: str, topic: str, key: str, n: int) -> None:
    await conn.execute(
        f'INSERT INTO "{schema}".outbox (topic, key, payload) VALUES ($1, $2, $3)',
        topic,
        key,
        json.dumps({"schema": schema, "n": n}),
    )


def by_outbox_and_key(records: list[Any]) -> dict[tuple[str, str], list[int]]:
    seen: dict[tuple[str, str], list[int]] = defaultdict(list)
    for r in records:
        body = json.loads(r.value)
        seen[(body["schema"], r.key.decode())].append(body["n"])
    return seen


async def sessions(conn: asyncpg.Connection, app_prefix: str) -> int:
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name LIKE $1",
            app_prefix + "%",
        )
    )


async def test_a_fleet_delivers_every_tenants_events_in_key_order(
    empty_db_dsn: str, services: Services, topic: str
) -> None:
    conn = await asyncpg.connect(empty_db_dsn)
    tenants = [f"tenant_{i}" for i in range(6)]
    try:
        for t in tenants[:5]:
            await migrate(conn, OutboxNames(t))
        # One tenant on a channel of its own: a second listener, not one per outbox.
        await migrate(conn, OutboxNames(tenants[5], channel="tenant_events"))
        async with Fleet([FleetDatabase(settings(empty_db_dsn, services), discover=True)]) as fleet:
            assert fleet.outboxes == [f"{t}.outbox" for t in tenants]
            for n in range(20):
                for t in tenants:
                    await insert(conn, t, topic, f"k{n % 3}", n)
            records, _ = await consume(services.bootstrap, topic, expect=120)
            # Woken by notifications naming each outbox, not by the poll.
            assert fleet.events.counts["wake:notification"] > 0
            assert fleet.events.counts["wake:poll"] == 0
            assert await sessions(conn, "notify-outbox-listener") == 2
            # The pool's bound (workers + 2), whatever the number of outboxes.
            assert await sessions(conn, "notify-outbox-worker") <= 6
        assert await topic_total(services.bootstrap, topic) == 120
    finally:
        await conn.close()
    seen = by_outbox_and_key(records)
    for t in tenants:
        for k in range(3):
            assert seen[(t, f"k{k}")] == [n for n in range(20) if n % 3 == k]


async def test_a_new_tenant_is_served_without_a_restart_and_a_dropped_one_let_go(
    empty_db_dsn: str, services: Services, topic: str
) -> None:
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        await migrate(conn, OutboxNames("tenant_a"))
        await migrate(conn, OutboxNames("tenant_b"))
        async with Fleet(
            [
                FleetDatabase(
                    settings(empty_db_dsn, services), discover=True, schemas_like="tenant\\_%"
                )
            ]
        ) as fleet:
            assert fleet.outboxes == ["tenant_a.outbox", "tenant_b.outbox"]
            # Migrating a new tenant notifies the registry: served at once, not in 60 s.
            await migrate(conn, OutboxNames("tenant_c"))
            await migrate(conn, OutboxNames("other"))  # outside the pattern: not served
            with anyio.fail_after(30):
                while "tenant_c.outbox" not in fleet.outboxes:
                    await fleet.events.wait_after(fleet.events.seen)
            await insert(conn, "tenant_c", topic, "k", 1)
            await consume(services.bootstrap, topic, expect=1)
            assert "other.outbox" not in fleet.outboxes

            leaving = fleet.relay("tenant_b.outbox")
            assert leaving is not None
            await conn.execute("DROP SCHEMA tenant_b CASCADE")
            await fleet.rediscover()
            with anyio.fail_after(30):
                await fleet.events.wait_for("outbox_stopped")
            assert leaving.outcome == "stopped"
            assert fleet.outboxes == ["tenant_a.outbox", "tenant_c.outbox"]
            # The others go on: the poll statement is rebuilt without the dropped table.
            await insert(conn, "tenant_a", topic, "k", 2)
            await consume(services.bootstrap, topic, expect=2)
            assert fleet.failing() == {}
    finally:
        await conn.close()


async def test_a_tenant_that_cannot_be_served_is_reported_and_the_others_deliver(
    empty_db_dsn: str, services: Services, topic: str
) -> None:
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        await migrate(conn, OutboxNames("tenant_a"))
        # Behind the shipped migrations: its relay refuses to start (MigrationError).
        await migrate(conn, OutboxNames("tenant_old"), up_to=2)
        async with Fleet([FleetDatabase(settings(empty_db_dsn, services), discover=True)]) as fleet:
            with anyio.fail_after(30):
                while "tenant_old.outbox" not in fleet.failing():
                    await fleet.events.wait_after(fleet.events.seen)
            assert "migrate" in fleet.failing()["tenant_old.outbox"]
            assert fleet.ready
            await insert(conn, "tenant_a", topic, "k", 1)
            await consume(services.bootstrap, topic, expect=1)
            # Migrated up to date: the registry notification brings it in, no restart.
            await migrate(conn, OutboxNames("tenant_old"))
            await insert(conn, "tenant_old", topic, "k", 2)
            await consume(services.bootstrap, topic, expect=2)
            assert fleet.failing() == {}
    finally:
        await conn.close()


async def test_the_fallback_poll_finds_rows_of_any_outbox(
    empty_db_dsn: str, services: Services, topic: str
) -> None:
    """Notifications off in one tenant's outbox: one poll statement for the database finds its
    rows, and only that outbox runs its own poll."""
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        for t in ("tenant_a", "tenant_b", "tenant_c"):
            await migrate(conn, OutboxNames(t))
        await conn.execute("UPDATE tenant_b.outbox_config SET notify_mode = 'off'")
        async with Fleet(
            [FleetDatabase(settings(empty_db_dsn, services, poll_interval=0.2), discover=True)]
        ) as fleet:
            b = fleet.relay("tenant_b.outbox")
            a = fleet.relay("tenant_a.outbox")
            assert a is not None
            assert b is not None
            with anyio.fail_after(30):
                await b.events.wait_for("idle")  # its start's claim is over
            await insert(conn, "tenant_b", topic, "k", 1)
            records, _ = await consume(services.bootstrap, topic, expect=1)
            assert json.loads(records[0].value) == {"schema": "tenant_b", "n": 1}
            assert b.events.counts["wake:poll"] >= 1, dict(b.events.counts)
            assert a.events.counts["poll"] == 0  # idle: the database's statement said so
            assert fleet.events.counts["fleet_poll"] >= 1
    finally:
        await conn.close()


async def _get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    def fetch() -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    return await anyio.to_thread.run_sync(fetch)


async def test_metrics_are_labelled_by_outbox_and_readyz_lists_the_failing_ones(
    empty_db_dsn: str, services: Services, topic: str
) -> None:
    """Per-outbox series (past the cap, under _other), the table gauges of every outbox from
    one statement, and /readyz ready with a failing tenant listed."""
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        for t in ("tenant_a", "tenant_b", "tenant_c"):
            await migrate(conn, OutboxNames(t))
        await migrate(conn, OutboxNames("tenant_old"), up_to=2)
        # Pending rows the fleet cannot deliver yet: a topic that does not exist, retried.
        await insert(conn, "tenant_b", "no-such-topic-" + topic, "k", 0)
        fleet = Fleet(
            [
                FleetDatabase(
                    settings(empty_db_dsn, services, retry_base_delay=3600, retry_max_delay=3600),
                    discover=True,
                )
            ]
        )
        metrics = FleetMetrics(fleet, max_outboxes=2)
        server = MonitoringServer(metrics, "127.0.0.1", 0)
        await server.start()
        metrics.start(refresh=False)
        try:
            async with fleet:
                with anyio.fail_after(30):
                    while "tenant_old.outbox" not in fleet.failing():
                        await fleet.events.wait_after(fleet.events.seen)
                    await fleet.events.wait_for("retried")
                for t, n in (("tenant_a", 3), ("tenant_c", 2)):
                    for i in range(n):
                        await insert(conn, t, topic, "k", i)
                await consume(services.bootstrap, topic, expect=5)
                with anyio.fail_after(30):
                    while fleet.events.counts["published"] < 5:
                        await fleet.events.wait_after(fleet.events.seen)

                port = server.port
                published = "notify_outbox_published_total"
                counts = {
                    table: await anyio.to_thread.run_sync(
                        lambda t=table: metric(port, published, table=t)
                    )
                    for table in ("tenant_a.outbox", "tenant_b.outbox", "_other")
                }
                # The first two outboxes have series of their own, the third adds up in _other.
                assert counts == {"tenant_a.outbox": 3.0, "tenant_b.outbox": 0.0, "_other": 2.0}
                pending = await anyio.to_thread.run_sync(
                    lambda: metric(port, "notify_outbox_pending_events", table="tenant_b.outbox")
                )
                assert pending == 1.0

                status, body = await _get(port, "/readyz")
                assert status == 200, body
                assert "tenant_old.outbox" in body["checks"]["outboxes"]
                assert "migrate" in body["checks"]["outboxes"]
        finally:
            await server.close()
            await metrics.aclose()
    finally:
        await conn.close()


def test_the_daemon_serves_the_databases_of_a_fleet_file(
    services: Services, topic: str, tmp_path: Path
) -> None:
    """``NOTIFY_OUTBOX_FLEET_FILE``: one process, a schema-per-tenant database (discovered) and
    a service's database (listed, on a channel of its own), its DSN from a variable."""
    tenants, billing = new_database(services), new_database(services)
    try:

        async def setup() -> None:
            for dsn, names in (
                (tenants, [OutboxNames("tenant_a"), OutboxNames("tenant_b")]),
                (billing, [OutboxNames("public", channel="billing_events")]),
            ):
                conn = await asyncpg.connect(dsn)
                try:
                    for n in names:
                        await migrate(conn, n)
                finally:
                    await conn.close()

        anyio.run(setup)
        fleet_file = tmp_path / "fleet.toml"
        fleet_file.write_text(
            '[[database]]\noutboxes = "*"\n\n'
            '[[database]]\ndsn_env = "BILLING_DSN"\noutboxes = ["public.outbox"]\n'
            'channel = "billing_events"\n'
        )
        env = {"NOTIFY_OUTBOX_FLEET_FILE": str(fleet_file), "BILLING_DSN": billing}
        with RelayProcess(tenants, services.bootstrap, env=env) as relay:
            line = relay.wait_for_line("fleet running")
            assert "3 outboxes of 2 database(s)" in line

            async def produce() -> list[Any]:
                for dsn, schema in (
                    (tenants, "tenant_a"),
                    (tenants, "tenant_b"),
                    (billing, "public"),
                ):
                    conn = await asyncpg.connect(dsn)
                    try:
                        await insert(conn, schema, topic, "k", 1)
                    finally:
                        await conn.close()
                records, _ = await consume(services.bootstrap, topic, expect=3)
                return records

            records = anyio.run(produce)
            assert relay.stop() == 0
        assert sorted(json.loads(r.value)["schema"] for r in records) == [
            "public",
            "tenant_a",
            "tenant_b",
        ]
    finally:
        for dsn in (tenants, billing):
            drop_database(services, dsn)


async def test_a_draining_outbox_pauses_while_another_has_events(
    empty_db_dsn: str, services: Services, topic: str
) -> None:
    conn = await asyncpg.connect(empty_db_dsn)
    writer = await asyncpg.connect(empty_db_dsn)
    quiet = 0
    try:
        await migrate(conn, OutboxNames("busy"))
        await migrate(conn, OutboxNames("quiet"))
        s = settings(empty_db_dsn, services, batch_size=100, outbox_drain_share=0.5)
        async with Fleet([FleetDatabase(s, discover=True)]) as fleet:
            drained = anyio.Event()

            async def other_tenant() -> None:
                # A tenant with events all along the drain (an event every 20 ms).
                nonlocal quiet
                while not drained.is_set():
                    await insert(writer, "quiet", topic, "q", quiet)
                    quiet += 1
                    await anyio.sleep(0.02)

            async with anyio.create_task_group() as tg:
                tg.start_soon(other_tenant)
                await fleet.events.wait_for("wake:notification", 3)
                await conn.execute(
                    "INSERT INTO busy.outbox (topic, key, payload) SELECT $1, 'k' || (g % 5), "
                    "json_build_object('schema', 'busy', 'n', g) FROM generate_series(0, 999) g "
                    "ORDER BY g",
                    topic,
                )
                with anyio.fail_after(60):
                    while await conn.fetchval(
                        "SELECT count(*) FROM busy.outbox WHERE published_at IS NULL"
                    ):
                        await fleet.events.wait_for(
                            "batch_done", fleet.events.counts["batch_done"] + 1
                        )
                drained.set()
            # Ten full claims of the backlog, each followed by a pause: the quiet tenant had
            # events within the last second at every one.
            assert fleet.events.counts["drain_paused"] >= 5
            records, _ = await consume(services.bootstrap, topic, expect=1000 + quiet)
    finally:
        await writer.close()
        await conn.close()
    seen = by_outbox_and_key(records)
    for k in range(5):
        assert seen[("busy", f"k{k}")] == list(range(k, 1000, 5))
    assert seen[("quiet", "q")] == list(range(quiet))


async def test_a_failing_tenant_and_a_held_snapshot_hold_back_only_that_tenant(
    empty_db_dsn: str, services: Services, topic: str
) -> None:
    conn = await asyncpg.connect(empty_db_dsn)
    holder = await asyncpg.connect(empty_db_dsn)
    missing = f"missing-{uuid.uuid4().hex[:8]}"  # auto-creation is off on the test broker
    try:
        await migrate(conn, OutboxNames("failing"))
        await migrate(conn, OutboxNames("healthy"))
        for n in range(300):
            await conn.execute(
                "INSERT INTO failing.outbox (topic, key, payload) VALUES ($1, $2, $3)",
                missing,
                f"f{n % 10}",
                json.dumps({"schema": "failing", "n": n}),
            )
        s = settings(empty_db_dsn, services, max_attempts=1000, retry_base_delay=0.05)
        async with Fleet([FleetDatabase(s, discover=True)]) as fleet:
            await fleet.events.wait_for("retried", 1)  # the failing tenant's rows fail
            # A snapshot held open across the healthy tenant's commits (as pg_dump holds one),
            # on the failing tenant's table.
            tx = holder.transaction(isolation="repeatable_read")
            await tx.start()
            assert await holder.fetchval("SELECT count(*) FROM failing.outbox") == 300
            for n in range(30):
                await insert(conn, "healthy", topic, f"k{n % 3}", n)
            records, _ = await consume(services.bootstrap, topic, expect=30, within=30)
            await tx.rollback()
            pending = await conn.fetchval(
                "SELECT count(*) FROM failing.outbox WHERE published_at IS NULL"
            )
            dead = await conn.fetchval("SELECT count(*) FROM failing.outbox_dead_letter")
    finally:
        await holder.close()
        await conn.close()
    seen = by_outbox_and_key(records)
    for k in range(3):
        assert seen[("healthy", f"k{k}")] == [n for n in range(30) if n % 3 == k]
    assert pending == 300  # still retried: nothing of it was sent, nor dead-lettered
    assert dead == 0


async def test_a_fleet_relays_each_tenants_debezium_table_and_an_inbox_applies_each_event_once(
    empty_db_dsn: str, services: Services
) -> None:
    """The Debezium-compatible mode per outbox: two tenants, each with the router's table and
    the capture into its own relay outbox, served by one fleet with the Debezium header style.
    Each tenant's events arrive as the router would emit them (topic, key, value, the one
    header ``id``), in insert order; an inbox reading that header applies each event once,
    and a second delivery of all of them applies none."""
    sfx = uuid.uuid4().hex[:8]
    tenants = {"tenant_a": f"OrderA{sfx}", "tenant_b": f"OrderB{sfx}"}
    topics = [f"outbox.event.{kind}" for kind in tenants.values()]
    await create_topics(services.bootstrap, topics)
    conn = await asyncpg.connect(empty_db_dsn)
    rows: dict[str, list[tuple[uuid.UUID, str, str]]] = {}
    try:
        for tenant in tenants:
            await migrate(conn, OutboxNames(tenant, table="relay_outbox"))
            await conn.execute(
                f"CREATE TABLE {tenant}.outbox (id uuid PRIMARY KEY, aggregatetype varchar(255) "
                "NOT NULL, aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, "
                "payload jsonb)"
            )
            names = OutboxNames(tenant, table="relay_outbox")
            await install_capture(conn, DebeziumCapture(schema=tenant), names)
            assert (await verify_capture(conn, DebeziumCapture(schema=tenant), names)).ok
            rows[tenant] = [(uuid.uuid4(), f"{n % 2}", f'{{"n": {n}}}') for n in range(10)]
        relayed = settings(empty_db_dsn, services, table="relay_outbox", header_style="debezium")
        async with Fleet([FleetDatabase(relayed, discover=True)]) as fleet:
            assert fleet.outboxes == [f"{t}.relay_outbox" for t in tenants]
            for n in range(10):
                for tenant, kind in tenants.items():
                    eid, key, payload = rows[tenant][n]
                    await conn.execute(
                        f"INSERT INTO {tenant}.outbox (id, aggregatetype, aggregateid, type, "
                        "payload) VALUES ($1, $2, $3, 'OrderCreated', $4)",
                        eid,
                        kind,
                        key,
                        payload,
                    )
            got = {}
            for tenant, kind in tenants.items():
                records, _ = await consume(services.bootstrap, f"outbox.event.{kind}", expect=10)
                got[tenant] = sorted(records, key=lambda r: (r.partition, r.offset))
        for tenant, kind in tenants.items():
            assert await topic_total(services.bootstrap, f"outbox.event.{kind}") == 10
            for key in ("0", "1"):
                sent = [(e, p) for e, k, p in rows[tenant] if k == key]
                came = [r for r in got[tenant] if r.key == key.encode()]
                # Insert order per key; the value is the jsonb column's text; one header, id.
                assert [(list(r.headers), r.value) for r in came] == [
                    ([("id", str(e).encode())], p.encode()) for e, p in sent
                ]
        await migrate_inbox(conn)
        await conn.execute("CREATE TABLE applied (event_id text)")
        inbox = Inbox(consumer="orders", id_header="id")
        everything = [r for tenant in tenants for r in got[tenant]]
        for delivery in (1, 2):
            fresh = 0
            for record in everything:
                async with conn.transaction(), inbox.process(conn, record) as new:
                    if new:
                        fresh += 1
                        await conn.execute(
                            "INSERT INTO applied VALUES ($1)", inbox.event_id(record)
                        )
            assert fresh == (20 if delivery == 1 else 0), f"delivery {delivery}: {fresh} fresh"
        assert sorted(await conn.fetchval("SELECT array_agg(event_id) FROM applied")) == sorted(
            str(e) for tenant in tenants for e, _, _ in rows[tenant]
        )
    finally:
        await conn.close()
