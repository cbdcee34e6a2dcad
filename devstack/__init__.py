"""Local PostgreSQL + Kafka services for notify-outbox's tests, without Docker.

Not part of the shipped library: it drives the PostgreSQL binaries installed on
the machine and a Kafka broker whose jars Maven fetches once into a cache (likewise an
Apicurio schema registry, for the tests that need one).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

from devstack._common import StackError, free_ports
from devstack.kafka import KAFKA_VERSION, KafkaBroker, kafka_classpath
from devstack.pgbouncer import PgBouncer
from devstack.postgres import PostgresServer, PostgresStandby
from devstack.schema_registry import APICURIO_VERSION, SchemaRegistryServer

__all__ = [
    "APICURIO_VERSION",
    "KAFKA_VERSION",
    "KafkaBroker",
    "PgBouncer",
    "PostgresServer",
    "PostgresStandby",
    "SchemaRegistryServer",
    "Stack",
    "StackError",
    "kafka_classpath",
]

STACK_DIR_ENV = "NOTIFY_OUTBOX_STACK_DIR"


def _default_base_dir() -> Path:
    root = os.environ.get(STACK_DIR_ENV)
    parent = Path(root) if root else Path(tempfile.gettempdir()) / "notify-outbox-stack"
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="stack-", dir=parent))


class Stack:
    """PostgreSQL and Kafka side by side under one base directory.

    Usable as a context manager: ``with Stack() as stack: ...`` starts both
    services and stops them on exit.
    """

    def __init__(self, base_dir: Path | None = None, *, durable: bool = True) -> None:
        self.base_dir = (Path(base_dir) if base_dir is not None else _default_base_dir()).resolve()
        self.durable = durable
        self.postgres = PostgresServer(self.base_dir / "postgres", durable=durable)
        self.kafka = KafkaBroker(self.base_dir / "kafka")
        if self.postgres.port in (self.kafka.port, self.kafka.controller_port):
            # Both picked "free" ports independently before either listens; a
            # clash is rare but would surface as a baffling start failure.
            port, controller_port = free_ports(2, avoid=[self.postgres.port])
            self.kafka = KafkaBroker(
                self.base_dir / "kafka", port=port, controller_port=controller_port
            )

    def __repr__(self) -> str:
        return f"Stack(base_dir={str(self.base_dir)!r}, durable={self.durable})"

    def start(self) -> None:
        """Start both services concurrently; on any failure stop both and re-raise."""
        # Kafka dominates start-up time (JVM, Maven on a cold cache), so
        # PostgreSQL starts in parallel instead of after it.
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="devstack") as pool:
            futures = [pool.submit(self.postgres.start), pool.submit(self.kafka.start)]
            errors = [exc for f in futures if (exc := f.exception()) is not None]
        if errors:
            # The start error is the one worth reporting, not a follow-up one.
            with contextlib.suppress(Exception):
                self.stop()
            raise errors[0]

    def stop(self) -> None:
        """Stop both services; raise the first error only after trying both."""
        errors: list[BaseException] = []
        for stop in (self.kafka.stop, self.postgres.stop):
            try:
                stop()
            except Exception as exc:  # the other service must still stop
                errors.append(exc)
        if errors:
            raise errors[0]

    def env(self) -> dict[str, str]:
        """Environment variables that point the project's tests at this stack."""
        return {
            "NOTIFY_OUTBOX_TEST_DSN": self.postgres.dsn,
            "NOTIFY_OUTBOX_TEST_BOOTSTRAP_SERVERS": self.kafka.bootstrap_servers,
        }

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
