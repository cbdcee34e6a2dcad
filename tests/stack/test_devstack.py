"""Tests of the local service stack itself, against a real PostgreSQL and Kafka."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaTimeoutError, UnknownTopicOrPartitionError

import devstack.kafka
from devstack import KafkaBroker, PostgresServer, PostgresStandby, Stack, kafka_classpath
from devstack.kafka import kafka_cache_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
# Generous bounds: the broker shares two cores with PostgreSQL and the tests.
KAFKA_WAIT_S = 60.0
PG_WAIT_S = 15.0


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Both services, started once for the whole session."""
    services = Stack(tmp_path_factory.mktemp("stack"), durable=False)
    services.start()
    try:
        yield services
    finally:
        services.stop()


def _topic() -> str:
    return f"devstack-{uuid.uuid4().hex[:12]}"


async def _create_topic(bootstrap: str, name: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()


async def _list_topics(bootstrap: str) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return list(await admin.list_topics())
    finally:
        await admin.close()


async def _produce(bootstrap: str, topic: str, value: bytes) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all")
    await producer.start()
    try:
        await asyncio.wait_for(producer.send_and_wait(topic, value, key=b"k"), KAFKA_WAIT_S)
    finally:
        await producer.stop()


async def _consume(bootstrap: str, topic: str, count: int, group: str | None = None) -> list[bytes]:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        values: list[bytes] = []
        while len(values) < count:
            record: Any = await asyncio.wait_for(consumer.getone(), KAFKA_WAIT_S)
            values.append(record.value)
        return values
    finally:
        await consumer.stop()


async def _roundtrip(bootstrap: str, group: str | None = None) -> None:
    topic = _topic()
    await _create_topic(bootstrap, topic)
    await _produce(bootstrap, topic, b"hello")
    assert await _consume(bootstrap, topic, 1, group) == [b"hello"]


def test_kafka_idempotent_produce_then_consume(stack: Stack) -> None:
    asyncio.run(_roundtrip(stack.kafka.bootstrap_servers, group=f"g-{uuid.uuid4().hex}"))


def test_kafka_missing_topic_is_not_auto_created(stack: Stack) -> None:
    bootstrap = stack.kafka.bootstrap_servers
    topic = _topic()

    async def scenario() -> None:
        producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap, enable_idempotence=True, request_timeout_ms=2000
        )
        await producer.start()
        try:
            with pytest.raises((UnknownTopicOrPartitionError, KafkaTimeoutError)):
                await asyncio.wait_for(producer.send_and_wait(topic, b"lost"), 20)
        finally:
            await producer.stop()
        assert topic not in await _list_topics(bootstrap)

    asyncio.run(scenario())


def test_postgres_notify_reaches_listener(stack: Stack) -> None:
    dsn = stack.postgres.dsn

    async def scenario() -> None:
        received = asyncio.Event()
        payloads: list[str] = []

        def on_notify(_conn: object, _pid: int, _channel: str, payload: str) -> None:
            payloads.append(payload)
            received.set()

        listener = await asyncpg.connect(dsn)
        sender = await asyncpg.connect(dsn)
        try:
            await listener.add_listener("devstack_test", on_notify)
            await sender.execute("SELECT pg_notify('devstack_test', 'ping')")
            await asyncio.wait_for(received.wait(), PG_WAIT_S)
        finally:
            await sender.close()
            await listener.close()
        assert payloads == ["ping"]

    asyncio.run(scenario())


def test_postgres_settings_and_auth(stack: Stack) -> None:
    pg = stack.postgres

    async def scenario() -> None:
        conn = await asyncpg.connect(pg.dsn)
        try:
            assert await conn.fetchval("SHOW shared_preload_libraries") == "pg_stat_statements"
            assert await conn.fetchval("SHOW max_connections") == "400"
            assert await conn.fetchval("SHOW fsync") == "off"
            await conn.execute("DROP ROLE IF EXISTS devstack_app")
            await conn.execute("CREATE ROLE devstack_app LOGIN PASSWORD 'app-secret'")
        finally:
            await conn.close()
        # Only the superuser is trusted over TCP; other roles must authenticate.
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(pg.dsn_for("postgres", "devstack_app", "wrong"))
        app = await asyncpg.connect(pg.dsn_for("postgres", "devstack_app", "app-secret"))
        try:
            assert await app.fetchval("SELECT current_user") == "devstack_app"
        finally:
            await app.close()

    asyncio.run(scenario())


def test_second_handle_on_same_dir_controls_same_services(stack: Stack) -> None:
    pg = PostgresServer(stack.postgres.base_dir)
    broker = KafkaBroker(stack.kafka.base_dir)
    assert pg.port == stack.postgres.port
    assert pg.is_running()
    assert broker.port == stack.kafka.port
    assert broker.controller_port == stack.kafka.controller_port
    assert broker.pid == stack.kafka.pid
    assert broker.is_running()


def test_kafka_restart(stack: Stack) -> None:
    bootstrap = stack.kafka.bootstrap_servers
    before = _topic()
    asyncio.run(_create_topic(bootstrap, before))
    asyncio.run(_produce(bootstrap, before, b"before restart"))
    old_pid = stack.kafka.pid

    stack.kafka.restart()

    assert stack.kafka.is_running()
    assert stack.kafka.pid != old_pid
    assert stack.kafka.bootstrap_servers == bootstrap
    assert asyncio.run(_consume(bootstrap, before, 1)) == [b"before restart"]
    asyncio.run(_roundtrip(bootstrap))


def test_kafka_survives_kill(stack: Stack) -> None:
    bootstrap = stack.kafka.bootstrap_servers
    topic = _topic()
    asyncio.run(_create_topic(bootstrap, topic))
    asyncio.run(_produce(bootstrap, topic, b"before crash"))

    stack.kafka.kill()
    assert not stack.kafka.is_running()
    stack.kafka.start()

    assert asyncio.run(_consume(bootstrap, topic, 1)) == [b"before crash"]
    asyncio.run(_roundtrip(bootstrap))


def test_postgres_restart_keeps_data(stack: Stack) -> None:
    pg = stack.postgres
    port = pg.port
    table = f"devstack_{uuid.uuid4().hex[:12]}"

    async def write() -> None:
        conn = await asyncpg.connect(pg.dsn)
        try:
            await conn.execute(f"CREATE TABLE {table} (v text)")
            await conn.execute(f"INSERT INTO {table} VALUES ('kept')")
        finally:
            await conn.close()

    async def read() -> list[str]:
        conn = await asyncpg.connect(pg.dsn)
        try:
            return [row["v"] for row in await conn.fetch(f"SELECT v FROM {table}")]
        finally:
            await conn.close()

    asyncio.run(write())
    pg.restart()
    assert pg.is_running()
    assert pg.port == port
    assert asyncio.run(read()) == ["kept"]


def test_postgres_standby_streams_then_takes_over_when_promoted(tmp_path: Path) -> None:
    """A pg_basebackup replica of its own primary (not the session's cluster: the primary is
    stopped) streams, refuses writes, and accepts them once promoted; a multi-host DSN with
    target_session_attrs=read-write follows the writable one."""
    primary = PostgresServer(tmp_path / "primary", durable=False)
    standby = PostgresStandby(tmp_path / "standby", primary)
    both = (
        f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/postgres"
        "?target_session_attrs=read-write"
    )

    async def replicated() -> None:
        conn = await asyncpg.connect(primary.dsn)
        try:
            await conn.execute("CREATE TABLE kept (v text); INSERT INTO kept VALUES ('a')")
        finally:
            await conn.close()
        replica = await asyncpg.connect(standby.dsn)
        try:
            for _ in range(int(PG_WAIT_S / 0.05)):
                if await replica.fetchval("SELECT to_regclass('kept') IS NOT NULL"):
                    break
                await asyncio.sleep(0.05)
            assert await replica.fetchval("SELECT v FROM kept") == "a"
            with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
                await replica.execute("INSERT INTO kept VALUES ('b')")
        finally:
            await replica.close()

    async def writable_port() -> int:
        conn = await asyncpg.connect(both)
        try:
            await conn.execute("INSERT INTO kept VALUES ('w')")
            return int(await conn.fetchval("SELECT inet_server_port()"))
        finally:
            await conn.close()

    primary.start()
    try:
        standby.start()
        assert standby.is_standby()
        asyncio.run(replicated())
        assert asyncio.run(writable_port()) == primary.port
        primary.stop("fast")
        standby.promote()
        assert not standby.is_standby()
        assert asyncio.run(writable_port()) == standby.port
    finally:
        standby.stop()
        primary.stop()


def test_kafka_classpath_is_cached(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    # The stack fixture already resolved the jars, so the marker must exist.
    assert (kafka_cache_dir() / "complete.json").is_file()
    first = kafka_classpath()

    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a warm classpath lookup ran a subprocess: {args!r}")

    # devstack.kafka calls subprocess.run/Popen through the module, so this
    # catches a Maven (or any other) launch during the second lookup.
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    second = kafka_classpath()
    assert second == first
    assert any(jar.name == f"kafka_2.13-{devstack.kafka.KAFKA_VERSION}.jar" for jar in second)
    assert all(jar.is_file() for jar in second)


def test_cli_up_status_down(tmp_path: Path) -> None:
    directory = tmp_path / "cli"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "devstack", *args, "--dir", str(directory)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    up = cli("up", "--fast")
    try:
        assert up.returncode == 0, up.stderr
        exports = dict(
            line.removeprefix("export ").split("=", 1) for line in up.stdout.splitlines()
        )
        assert set(exports) == {
            "NOTIFY_OUTBOX_TEST_DSN",
            "NOTIFY_OUTBOX_TEST_BOOTSTRAP_SERVERS",
            "NOTIFY_OUTBOX_DSN",
            "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS",
        }
        # The services outlive the `up` process; this process controls them by pid.
        status = cli("status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert KafkaBroker(directory / "kafka").is_running()
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert not KafkaBroker(directory / "kafka").is_running()
    assert not PostgresServer(directory / "postgres").is_running()
    assert cli("status").returncode == 3
