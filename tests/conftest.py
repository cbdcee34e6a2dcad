"""Real services for every test that needs them.

Order of preference: ``NOTIFY_OUTBOX_TEST_DSN`` / ``NOTIFY_OUTBOX_TEST_BOOTSTRAP_SERVERS``;
otherwise testcontainers when a Docker engine answers; otherwise the project's own local
stack (``devstack``: a throwaway PostgreSQL cluster and a KRaft Kafka broker). If none can be
had, the tests fail with a message saying what to install. They never skip.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import asyncpg
import pytest

from notify_outbox import OutboxNames, migrate
from tests.pooling import Poolers, start_poolers
from tests.support import create_topics, dsn_with_database

if TYPE_CHECKING:
    from devstack.schema_registry import SchemaRegistryServer
    from tests.secured_kafka import SecuredKafka

TEMPLATE_DB = "notify_outbox_template"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Services:
    """Where the tests' PostgreSQL and Kafka are, and (for the local stack) how to restart
    them."""

    dsn: str  # a superuser DSN of the maintenance database
    bootstrap: str
    postgres: object | None = None  # devstack.PostgresServer when the project started it
    kafka: object | None = None  # devstack.KafkaBroker when the project started it


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def service_dir() -> Iterator[Callable[[str], Path]]:
    """Makes a fresh directory for a service's files (PostgreSQL, PgBouncer), outside
    pytest's own temporary directories: every pytest session of the same user sets
    ``/tmp/pytest-of-<user>`` back to mode 0700 when it starts, which would lock the
    service user out of a running cluster's data directory (a ``make unit`` beside ``make
    test`` crashed the tests' PostgreSQL with "Permission denied" on ``pg_control``)."""
    root = Path(tempfile.mkdtemp(prefix="notify-outbox-tests-"))

    def make(name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))

    try:
        yield make
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def services(service_dir: Callable[[str], Path]) -> Iterator[Services]:
    dsn = os.environ.get("NOTIFY_OUTBOX_TEST_DSN")
    bootstrap = os.environ.get("NOTIFY_OUTBOX_TEST_BOOTSTRAP_SERVERS")
    if dsn and bootstrap:
        yield Services(dsn, bootstrap)
        return
    if _docker_answers():
        yield from _containers(dsn, bootstrap)
        return
    yield from _local_stack(service_dir("stack"), dsn, bootstrap)


@pytest.fixture(scope="session")
def secured_kafka(service_dir: Callable[[str], Path]) -> Iterator[SecuredKafka]:
    """A second Kafka broker, secured (issue #33): SASL_SSL with SCRAM-SHA-512 and PLAIN
    users and OAUTHBEARER (unsecured JWTs), a listener requiring client certificates, ACLs
    enforced (see ``devstack.kafka_secured``). Started from the plain broker's cached jars by
    the first test that asks for it, stopped at the end of the session;
    ``tests.secured_kafka`` says how to connect to it and creates topics and ACLs as its
    super user."""
    try:
        from devstack import StackError
        from devstack.kafka_secured import SecuredKafkaBroker
        from tests.secured_kafka import SecuredKafka
    except ImportError as e:
        pytest.fail(
            f"the secured Kafka broker needs the Python package {e.name!r}: "
            "pip install -e '.[dev]'",
            pytrace=False,
        )
    broker = SecuredKafkaBroker(service_dir("kafka-secured"))
    try:
        broker.start()
    except StackError as e:
        pytest.fail(
            f"no secured Kafka broker for the tests: {e}\n"
            "It needs Java 17 and Maven (for the Kafka jars, cached after the first run).",
            pytrace=False,
        )
    try:
        yield SecuredKafka(broker)
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def schema_registry(service_dir: Callable[[str], Path]) -> Iterator[SchemaRegistryServer]:
    """A Confluent-compatible Schema Registry (Apicurio Registry 3.0.9, its ``ccompat`` API,
    BACKWARD compatibility as Confluent's default), fetched once from Maven Central and run
    on the local Java; its schemas survive a ``restart()`` (issue #33, part 2)."""
    from devstack import StackError
    from devstack.schema_registry import SchemaRegistryServer

    server = SchemaRegistryServer(service_dir("schema-registry"))
    try:
        server.start()
    except StackError as e:
        pytest.fail(
            f"no Schema Registry for the tests: {e}\n"
            "It needs Java 17 and Maven (for Apicurio's distribution, cached after the first run).",
            pytrace=False,
        )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def poolers(services: Services, service_dir: Callable[[str], Path]) -> Iterator[Poolers]:
    """A transaction-mode and a session-mode PgBouncer in front of the tests' PostgreSQL."""
    from devstack import StackError

    try:
        pools = start_poolers(services.dsn, service_dir("pgbouncer"))
    except StackError as e:
        pytest.fail(f"no PgBouncer for the tests: {e}", pytrace=False)
    try:
        yield pools
    finally:
        pools.stop()


@pytest.fixture(autouse=True)
def _pgbouncer_crash_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test during which a pooler crashed, and restart it for the next ones."""
    yield
    if "poolers" in request.fixturenames:
        crashes = request.getfixturevalue("poolers").restart_crashed()
        if crashes:
            pytest.fail("\n".join(crashes), pytrace=False)


@pytest.fixture(params=["transaction", "session"])
def pooled_dsn(request: pytest.FixtureRequest, poolers: Poolers, db_dsn: str) -> str:
    """This test's database through PgBouncer, once per pool mode (see the test id)."""
    return poolers.dsn_through(request.param, db_dsn)


def _containers(dsn: str | None, bootstrap: str | None) -> Iterator[Services]:
    from testcontainers.kafka import KafkaContainer
    from testcontainers.postgres import PostgresContainer

    pg = kafka = None
    try:
        if not dsn:
            pg = PostgresContainer("postgres:15", driver=None).start()
            dsn = pg.get_connection_url()
        if not bootstrap:
            kafka = KafkaContainer("confluentinc/cp-kafka:7.6.0").with_kraft()
            kafka.with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false").start()
            bootstrap = kafka.get_bootstrap_server()
        yield Services(dsn, bootstrap)
    finally:
        for c in (kafka, pg):
            if c is not None:
                c.stop()


def _local_stack(base: Path, dsn: str | None, bootstrap: str | None) -> Iterator[Services]:
    from devstack import KafkaBroker, PostgresServer, StackError

    pg = kafka = None
    try:
        try:
            if not dsn:
                pg = PostgresServer(base / "postgres", durable=False)
                pg.start()
                dsn = pg.dsn
            if not bootstrap:
                kafka = KafkaBroker(base / "kafka")
                kafka.start()
                bootstrap = kafka.bootstrap_servers
        except StackError as e:
            pytest.fail(
                f"no PostgreSQL/Kafka for the tests: {e}\n"
                "Set NOTIFY_OUTBOX_TEST_DSN and NOTIFY_OUTBOX_TEST_BOOTSTRAP_SERVERS, run a "
                "Docker engine, or install Java 17, Maven and the PostgreSQL 15 binaries.",
                pytrace=False,
            )
        yield Services(dsn, bootstrap, pg, kafka)
    finally:
        for service in (kafka, pg):
            if service is not None:
                service.stop()  # type: ignore[attr-defined]


async def _admin(dsn: str, *statements: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for sql in statements:
            await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def template_db(services: Services) -> str:
    """A database with the default outbox migrated, cloned by every test (fast)."""

    async def build() -> None:
        await _admin(
            services.dsn,
            f'DROP DATABASE IF EXISTS "{TEMPLATE_DB}" WITH (FORCE)',
            f'CREATE DATABASE "{TEMPLATE_DB}"',
        )
        conn = await asyncpg.connect(dsn_with_database(services.dsn, TEMPLATE_DB))
        try:
            await migrate(conn, OutboxNames())
        finally:
            await conn.close()

    asyncio.run(build())
    return TEMPLATE_DB


def _clone(services: Services, template: str) -> Iterator[str]:
    """A superuser DSN of a fresh database cloned from ``template``, dropped after."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    asyncio.run(_admin(services.dsn, f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
    yield dsn_with_database(services.dsn, name)
    asyncio.run(_admin(services.dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def db_dsn(services: Services, template_db: str) -> Iterator[str]:
    """A superuser DSN of a fresh database of this test's own, already migrated."""
    yield from _clone(services, template_db)


@pytest.fixture(scope="module")
def module_db_dsn(services: Services, template_db: str) -> Iterator[str]:
    """A superuser DSN of a migrated database shared by the tests of one module, each of which
    empties the tables it uses first: one clone (about a second on a busy machine) per module
    instead of one per test."""
    yield from _clone(services, template_db)


@pytest.fixture
def empty_db_dsn(services: Services) -> Iterator[str]:
    """A superuser DSN of a fresh database with nothing migrated."""
    name = f"e_{uuid.uuid4().hex[:16]}"
    asyncio.run(_admin(services.dsn, f'CREATE DATABASE "{name}"'))
    yield dsn_with_database(services.dsn, name)
    asyncio.run(_admin(services.dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def topic(services: Services) -> str:
    """A fresh topic with 3 partitions (auto-creation is off on the test broker)."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    asyncio.run(create_topics(services.bootstrap, [name], partitions=3))
    return name


@pytest.fixture
def refusing() -> Iterator[socket.socket]:
    """A TCP socket bound to a port of its own but not listening: connections to it are
    refused (a Kafka that is down) until something listens on it (``tests.support.address``
    gives its host:port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock
    finally:
        sock.close()
