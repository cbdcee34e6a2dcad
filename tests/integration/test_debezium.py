"""Debezium-compatible mode against real PostgreSQL and Kafka: a table laid out for Debezium's
outbox event router, rows written with plain SQL, and every Kafka message compared field by
field (topic, key bytes, value bytes, the headers list) with what the router emits.

The expected messages are computed here from the router's documented defaults and source
(io.debezium.transforms.outbox.EventRouterDelegate, with Kafka Connect's StringConverter and
SimpleHeaderConverter): topic ``outbox.event.<aggregatetype>``, key the ``aggregateid`` text,
value the ``payload`` column's text (PostgreSQL's jsonb output, as the connector reads it),
one header ``id`` holding the event id; deletes and updates are not events; a NULL payload is a
record with a null value.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
from aiokafka import ConsumerRecord

from notify_outbox import ConfigurationError, MigrationError, OutboxNames, OutboxSettings, Relay
from notify_outbox.debezium.capture import DebeziumCapture, install_capture, verify_capture
from notify_outbox.pg.migrations import migrate
from tests.conftest import Services
from tests.support import ROOT, consume, create_topics, topic_total

pytestmark = pytest.mark.anyio

RELAY_TABLE = OutboxNames(table="relay_outbox")  # notify-outbox's own; "outbox" is Debezium's

# The table the router's documentation describes ("Basic outbox table").
DEBEZIUM_TABLE = """
CREATE TABLE public.outbox (
    id            uuid                   NOT NULL PRIMARY KEY,
    aggregatetype character varying(255) NOT NULL,
    aggregateid   character varying(255) NOT NULL,
    type          character varying(255) NOT NULL,
    payload       jsonb
)
"""


@dataclass(frozen=True)
class Expected:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]


def as_tuple(r: ConsumerRecord[bytes, bytes]) -> Expected:
    return Expected(r.topic, r.key, r.value, list(r.headers or ()))


def router_default(
    event_id: uuid.UUID, aggregatetype: str, aggregateid: str, payload_text: str | None
) -> Expected:
    """What EventRouter emits with no options set (see the module docstring)."""
    return Expected(
        topic=f"outbox.event.{aggregatetype}",
        key=aggregateid.encode(),
        value=None if payload_text is None else payload_text.encode(),
        headers=[("id", str(event_id).encode())],
    )


@pytest.fixture
async def conn(empty_db_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(empty_db_dsn)
    try:
        await migrate(c, RELAY_TABLE)
        yield c
    finally:
        await c.close()


def relay_settings(dsn: str, services: Services, **kw: Any) -> OutboxSettings:
    return OutboxSettings(
        dsn=dsn,
        kafka_bootstrap_servers=services.bootstrap,
        table=RELAY_TABLE.table,
        header_style="debezium",
        poll_interval=30.0,
        **kw,
    )


async def consume_all(
    services: Services, topics: dict[str, int]
) -> dict[str, list[ConsumerRecord[bytes, bytes]]]:
    out = {}
    for topic, n in topics.items():
        records, total = await consume(services.bootstrap, topic, expect=n, within=30)
        assert total == n, f"{topic}: {total} messages, expected {n} (something extra was sent)"
        out[topic] = sorted(records, key=lambda r: (r.partition, r.offset))
    return out


async def assert_nothing_extra(
    services: Services, got: dict[str, list[ConsumerRecord[bytes, bytes]]]
) -> None:
    """Once the relay stopped, each topic holds what ``consume_all`` read, and no late copy."""
    for topic, records in got.items():
        total = await topic_total(services.bootstrap, topic)
        assert total == len(records), f"{topic}: {total} messages once the relay stopped"


async def test_router_defaults_message_by_message(
    conn: asyncpg.Connection, empty_db_dsn: str, services: Services
) -> None:
    sfx = uuid.uuid4().hex[:8]
    order, customer = f"Order{sfx}", f"customer_{sfx}"
    await create_topics(services.bootstrap, [f"outbox.event.{order}", f"outbox.event.{customer}"])
    await conn.execute(DEBEZIUM_TABLE)
    await install_capture(conn, DebeziumCapture(), RELAY_TABLE)
    assert (await verify_capture(conn, DebeziumCapture(), RELAY_TABLE)).ok

    # The documentation's example event, a non-ASCII payload, and the same key twice.
    doc_payload = (
        '{"id": 1, "lineItems": [{"id": 1, "item": "Debezium in Action", "status": "ENTERED", '
        '"quantity": 2, "totalPrice": 39.98}], "orderDate": "2019-01-31T12:13:01", '
        '"customerId": 123}'
    )
    rows: list[tuple[uuid.UUID, str, str, str, str | None]] = [
        (uuid.uuid4(), order, "1", "OrderCreated", doc_payload),
        (uuid.uuid4(), customer, "c-7", "CustomerCreated", '{"name":"Zoë",  "tags":[]}'),
        (uuid.uuid4(), order, "1", "OrderLineUpdated", '{"line": 2}'),
        (uuid.uuid4(), order, "1", "OrderDeleted", None),  # NULL payload: null value
    ]
    insert = (
        "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload) "
        "VALUES ($1, $2, $3, $4, $5)"
    )
    async with Relay(relay_settings(empty_db_dsn, services)):
        for row in rows[:2]:
            await conn.execute(insert, *row)
        # Debezium users delete the row in the same transaction: the insert is the event.
        async with conn.transaction():
            await conn.execute(insert, *rows[2])
            await conn.execute("DELETE FROM outbox WHERE id = $1", rows[2][0])
        await conn.execute(insert, *rows[3])
        # Updates and deletes of existing rows are not events to the router.
        await conn.execute("UPDATE outbox SET type = 'Changed' WHERE id = $1", rows[0][0])
        await conn.execute("DELETE FROM outbox WHERE id = $1", rows[1][0])
        got = await consume_all(
            services, {f"outbox.event.{order}": 3, f"outbox.event.{customer}": 1}
        )
    await assert_nothing_extra(services, got)
    # The value is the jsonb column's text as PostgreSQL prints it (what the connector reads).
    texts = [
        None if p is None else await conn.fetchval("SELECT $1::jsonb::text", p) for (*_, p) in rows
    ]
    assert texts[1] == '{"name": "Zoë", "tags": []}'
    expected = [
        router_default(i, t, k, text) for (i, t, k, _, _), text in zip(rows, texts, strict=True)
    ]
    # Same key: one partition, insert order.
    assert [as_tuple(r) for r in got[f"outbox.event.{order}"]] == [
        expected[0],
        expected[2],
        expected[3],
    ]
    assert [as_tuple(r) for r in got[f"outbox.event.{customer}"]] == [expected[1]]
    assert await conn.fetchval("SELECT count(*) FROM relay_outbox") == 0  # all published


async def test_options_users_change_most_from_a_connector_config(
    conn: asyncpg.Connection, empty_db_dsn: str, services: Services, tmp_path: Path
) -> None:
    """The debezium-examples outbox demo's table and topic pattern, a custom key column, extra
    fields as headers (one with an alias), and tombstones for empty payloads; the options
    come from the connector's JSON as posted to Kafka Connect."""
    sfx = uuid.uuid4().hex[:8]
    agg = f"order_{sfx}"
    await create_topics(services.bootstrap, [f"{agg}.events"])
    await conn.execute(
        """
        CREATE SCHEMA inventory;
        CREATE TABLE inventory.outboxevent (
            id            uuid PRIMARY KEY,
            aggregatetype varchar(255) NOT NULL,
            aggregateid   varchar(255) NOT NULL,
            customer_id   bigint,
            "eventType"   varchar(255) NOT NULL,
            tenant        text NOT NULL,
            payload       text
        );
        """
    )
    config = tmp_path / "register-postgres.json"
    config.write_text(
        json.dumps(
            {
                "name": "outbox-connector",
                "config": {
                    "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
                    "table.include.list": "inventory.outboxevent",
                    "key.converter": "org.apache.kafka.connect.storage.StringConverter",
                    "value.converter": "org.apache.kafka.connect.storage.StringConverter",
                    "transforms": "outbox",
                    "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
                    "transforms.outbox.route.topic.replacement": "${routedByValue}.events",
                    "transforms.outbox.table.field.event.key": "customer_id",
                    "transforms.outbox.table.fields.additional.placement": (
                        "eventType:header:type, tenant:header"
                    ),
                    "transforms.outbox.route.tombstone.on.empty.payload": "true",
                },
            }
        )
    )
    cli = [
        "debezium",
        "--connector-config",
        str(config),
        "--source-schema",
        "inventory",
        "--source-table",
        "outboxevent",
        "--table",
        RELAY_TABLE.table,
    ]
    assert run_cli(empty_db_dsn, "install", *cli).returncode == 0
    check = run_cli(empty_db_dsn, "verify", *cli)
    assert check.returncode == 0, check.stdout + check.stderr
    stale = run_cli(empty_db_dsn, "verify", *cli, "--set", "table.field.event.key=aggregateid")
    assert stale.returncode == 4
    assert "differs from these options" in stale.stdout

    ids = [uuid.uuid4() for _ in range(3)]
    async with Relay(relay_settings(empty_db_dsn, services)):
        await conn.execute(
            """
            INSERT INTO inventory.outboxevent
                (id, aggregatetype, aggregateid, customer_id, "eventType", tenant, payload)
            VALUES ($1, $4, 'o-1', 42, 'OrderCreated', 'acme', '{"total": 10}'),
                   ($2, $4, 'o-1', 42, 'OrderShipped', 'acme', '   '),
                   ($3, $4, 'o-2', NULL, 'OrderCreated', 'globex', '{"total": 3}')
            """,
            *ids,
            agg,
        )
        got = await consume_all(services, {f"{agg}.events": 3})
    await assert_nothing_extra(services, got)
    by_id = {dict(r.headers)["id"]: as_tuple(r) for r in got[f"{agg}.events"]}

    def headers(i: uuid.UUID, event_type: str, tenant: str) -> list[tuple[str, bytes]]:
        # The router adds "id" first, then the additional fields in configuration order.
        return [("id", str(i).encode()), ("type", event_type.encode()), ("tenant", tenant.encode())]

    assert by_id[str(ids[0]).encode()] == Expected(
        f"{agg}.events", b"42", b'{"total": 10}', headers(ids[0], "OrderCreated", "acme")
    )
    # A blank payload with route.tombstone.on.empty.payload=true: a tombstone.
    assert by_id[str(ids[1]).encode()] == Expected(
        f"{agg}.events", b"42", None, headers(ids[1], "OrderShipped", "acme")
    )
    # A NULL key column: a null key.
    assert by_id[str(ids[2]).encode()] == Expected(
        f"{agg}.events", None, b'{"total": 3}', headers(ids[2], "OrderCreated", "globex")
    )


def run_cli(dsn: str, action: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd, *rest = args
    return subprocess.run(
        [sys.executable, "-m", "notify_outbox", cmd, action, *rest],
        env={"NOTIFY_OUTBOX_DSN": dsn, "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


# --- bad input ----------------------------------------------------------------------------


async def test_a_table_without_the_expected_columns_is_refused_by_name(
    conn: asyncpg.Connection, empty_db_dsn: str
) -> None:
    await conn.execute(
        "CREATE TABLE outbox (id uuid PRIMARY KEY, aggregate_type text, aggregateid text, "
        "payload jsonb)"
    )
    with pytest.raises(ConfigurationError, match=r"no column 'aggregatetype' \(route.by.field\)"):
        await install_capture(conn, DebeziumCapture(), RELAY_TABLE)
    assert not (await verify_capture(conn, DebeziumCapture(), RELAY_TABLE)).ok
    # The same through the CLI: one line, exit 2, and nothing installed.
    done = run_cli(empty_db_dsn, "install", "debezium", "--table", RELAY_TABLE.table)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "no column 'aggregatetype'" in done.stderr
    assert await conn.fetchval("SELECT count(*) FROM pg_trigger WHERE NOT tgisinternal") == 2


async def test_wrong_column_types_and_tables_are_refused(
    conn: asyncpg.Connection, empty_db_dsn: str
) -> None:
    await conn.execute(
        "CREATE TABLE outbox (id uuid, aggregatetype integer, aggregateid text, payload jsonb)"
    )
    with pytest.raises(ConfigurationError, match=r"'aggregatetype' .* has type int4"):
        await install_capture(conn, DebeziumCapture(), RELAY_TABLE)
    with pytest.raises(ConfigurationError, match="does not exist"):
        await install_capture(conn, DebeziumCapture(table="missing"), RELAY_TABLE)
    with pytest.raises(ConfigurationError, match=r"both public\.outbox"):
        await install_capture(conn, DebeziumCapture(), OutboxNames())
    with pytest.raises(MigrationError, match="run `notify-outbox migrate`"):
        await install_capture(conn, DebeziumCapture(), OutboxNames(table="never_migrated"))


@pytest.mark.parametrize(
    ("aggregatetype", "error", "message"),
    [
        (None, asyncpg.NotNullViolationError, "aggregatetype (route.by.field) is NULL"),
        ("Order Line", asyncpg.CheckViolationError, "not a valid Kafka topic name"),
    ],
)
async def test_rows_that_cannot_be_routed_fail_the_producers_insert(
    conn: asyncpg.Connection, aggregatetype: str | None, error: type[Exception], message: str
) -> None:
    # Nullable here, so that the capture is what refuses it.
    await conn.execute(
        DEBEZIUM_TABLE.replace("(255) NOT NULL,\n    aggregateid", "(255),\n    aggregateid")
    )
    await install_capture(conn, DebeziumCapture(), RELAY_TABLE)
    with pytest.raises(error, match=re.escape(message)):
        await conn.execute(
            "INSERT INTO outbox VALUES ($1, $2, '1', 'OrderCreated', '{}')",
            uuid.uuid4(),
            aggregatetype,
        )
    # Rolled back as a whole: no Debezium row, no relay row, nothing silently dropped.
    assert await conn.fetchval("SELECT count(*) FROM outbox") == 0
    assert await conn.fetchval("SELECT count(*) FROM relay_outbox") == 0


async def test_a_null_header_column_is_a_null_header_and_a_null_id_is_refused(
    conn: asyncpg.Connection, empty_db_dsn: str, services: Services
) -> None:
    """SimpleHeaderConverter turns a NULL column into a header with a null value; an event
    without an id has no ``id`` header to give, so its insert fails."""
    agg = f"order_{uuid.uuid4().hex[:8]}"
    await create_topics(services.bootstrap, [f"outbox.event.{agg}"])
    await conn.execute(
        DEBEZIUM_TABLE.replace(
            "type          character varying(255) NOT NULL", "type varchar(255)"
        ).replace("uuid                   NOT NULL PRIMARY KEY", "uuid")
    )
    capture = DebeziumCapture.from_options(
        {"table.fields.additional.placement": "type:header:eventType"}
    )
    await install_capture(conn, capture, RELAY_TABLE)
    with pytest.raises(asyncpg.NotNullViolationError, match=re.escape("column id (table.field")):
        await conn.execute("INSERT INTO outbox VALUES (NULL, $1, '1', 'Created', '{}')", agg)
    event_id = uuid.uuid4()
    async with Relay(relay_settings(empty_db_dsn, services)):
        await conn.execute("INSERT INTO outbox VALUES ($1, $2, '1', NULL, '{}')", event_id, agg)
        got = await consume_all(services, {f"outbox.event.{agg}": 1})
    await assert_nothing_extra(services, got)
    assert [as_tuple(r) for r in got[f"outbox.event.{agg}"]] == [
        Expected(
            f"outbox.event.{agg}",
            b"1",
            b"{}",
            [("id", str(event_id).encode()), ("eventType", None)],
        )
    ]


async def test_rows_not_written_by_the_capture_are_dead_lettered_not_dropped(
    conn: asyncpg.Connection, empty_db_dsn: str, services: Services
) -> None:
    topic = f"t-{uuid.uuid4().hex[:12]}"
    await create_topics(services.bootstrap, [topic])
    # A native row (no "id" header) reaching a relay in Debezium header style.
    await conn.execute(
        "INSERT INTO relay_outbox (topic, key, payload) VALUES ($1, 'k', '{}')", topic
    )
    async with Relay(relay_settings(empty_db_dsn, services)) as relay:
        with anyio.fail_after(30):
            await relay.events.wait_for("dead_lettered")
    error = await conn.fetchval("SELECT error FROM relay_outbox_dead_letter")
    assert "'id'" in error
    assert await conn.fetchval("SELECT count(*) FROM relay_outbox") == 0
