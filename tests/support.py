"""Helpers shared by the integration tests: topics, consuming, and the CLI as a subprocess."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

ROOT = Path(__file__).resolve().parent.parent


def dsn_with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path=f"/{database}"))


def dsn_with_user(dsn: str, user: str, password: str) -> str:
    parts = urlsplit(dsn)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{user}:{password}@{host}:{parts.port}" if parts.port else f"{user}:{password}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


async def create_topics(bootstrap: str, names: Sequence[str], *, partitions: int = 3) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(n, num_partitions=partitions, replication_factor=1) for n in names]
        )
    finally:
        await admin.close()


async def consume(
    bootstrap: str, topic: str, *, expect: int, within: float = 60.0
) -> tuple[list[ConsumerRecord[bytes, bytes]], int]:
    """Read ``topic`` from the beginning until ``expect`` messages arrived (or fail after
    ``within`` seconds). Returns the messages (per partition in offset order) and the total number
    of messages the topic holds right now, from its end offsets: a check that nothing extra
    was published, with no waiting."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic)
        if partitions is None:
            await consumer._client.force_metadata_update()
            partitions = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        records: list[ConsumerRecord[bytes, bytes]] = []
        with anyio.fail_after(within):
            while len(records) < expect:
                batch = await consumer.getmany(*tps, timeout_ms=200)
                for tp_records in batch.values():
                    records.extend(tp_records)
        ends = await consumer.end_offsets(tps)
        return records, sum(ends.values())
    finally:
        await consumer.stop()


def header(record: ConsumerRecord[bytes, bytes], name: str) -> str | None:
    for key, value in record.headers or ():
        if key == name:
            return value.decode()
    return None


class RelayProcess:
    """``python -m notify_outbox run`` in a subprocess; waits on its log lines (events from
    the code), never on sleeps."""

    def __init__(self, dsn: str, bootstrap: str, *args: str, env: dict[str, str] | None = None):
        full_env = {
            **os.environ,
            "NOTIFY_OUTBOX_DSN": dsn,
            "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "notify_outbox", "run", *args],
            env=full_env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for_line(self, pattern: str, timeout: float = 60.0) -> str:
        regex = re.compile(pattern)
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if regex.search(line):
                        return line
                seen = len(self.lines)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(
                        f"relay exited ({self.proc.returncode}) before logging {pattern!r}:\n"
                        + self.output()
                    )
                if not self._cond.wait(timeout):
                    raise AssertionError(
                        f"no log line {pattern!r} within {timeout}s:\n" + self.output()
                    )

    def wait_ready(self, timeout: float = 60.0) -> None:
        self.wait_for_line("relay running", timeout)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def __enter__(self) -> RelayProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
