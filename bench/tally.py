"""The drain consumer, run as its own process (``python -m bench _tally BOOTSTRAP TOPIC``).

It reads every partition of one topic from the *beginning* and tallies what arrives: unique
``outbox-event-id`` headers (repeats are counted, not tallied twice), the monotonic time of
the first arrival and of the arrival that brought the last new event, and per-key order: the
payload of a keyed event carries ``"s"``, its sequence number within its key, so an event whose
``s`` is below the highest already seen for its key is an order violation. The payload is JSON,
or (the drain's ``-avro`` modes) a record in Confluent's wire format: byte 0, a 4-byte schema
id, then the Avro body of ``bench.drain_schema.DRAIN_AVRO_SCHEMA``. A line protocol on
stdin/stdout:

    -> {"ready": true}                                     once positioned at the beginning
    <- {"cmd": "wait", "expect": 100000, "timeout": 300}
    -> {"unique": 100000, "complete": true, ...}           when all arrived, or at the timeout
    <- {"cmd": "quit"}
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from typing import Any

from aiokafka import AIOKafkaConsumer
from fastavro import parse_schema, schemaless_reader

from bench.consumer import assign_all, fetch_loop, serve_lines
from bench.drain_schema import DRAIN_AVRO_SCHEMA

_START_TIMEOUT = 30.0
_HEADER = "outbox-event-id"
# Confluent's wire format: magic byte 0 and a 4-byte schema id before the body. A JSON
# payload starts with "{", so the first byte alone tells the two apart.
_MAGIC = 0
_PREFIX = 5
# Parsed once: schemaless_reader would otherwise parse the schema on every record.
_AVRO = parse_schema(DRAIN_AVRO_SCHEMA)


def framed(value: bytes | None) -> bool:
    """Whether ``value`` is in Confluent's wire format (else it is read as JSON)."""
    return value is not None and len(value) >= _PREFIX and value[0] == _MAGIC


def sequence(value: bytes | None) -> int:
    """``s`` of a drain payload, JSON or Avro-framed (ValueError, TypeError or KeyError when
    it has none)."""
    raw = value or b""
    if framed(raw):
        try:
            record = schemaless_reader(io.BytesIO(raw[_PREFIX:]), _AVRO, None)
        except (EOFError, StopIteration, IndexError, UnicodeDecodeError) as e:
            # A truncated or foreign body: counted as unreadable like bad JSON.
            raise ValueError(f"not a drain Avro record: {e!r}") from None
        if not isinstance(record, dict):
            raise TypeError("Avro body is not a record")
        return int(record["s"])
    return int(json.loads(raw)["s"])


class Tally:
    """What has arrived so far (see the module docstring)."""

    def __init__(self) -> None:
        self.records = 0
        self.seen: set[bytes] = set()
        self.duplicates = 0
        self.no_id = 0
        self.first_ns = 0
        self.last_ns = 0
        self.keyed = 0
        self.violations = 0
        self.unordered = 0  # keyed events without a readable "s"
        self.avro = 0  # unique events in the wire format: an -avro mode's proof of encoding
        self.last_seq: dict[bytes, int] = {}
        self.changed = asyncio.Event()

    def add(self, key: bytes | None, value: bytes | None, headers: Any, recv_ns: int) -> None:
        """Tally one record received at ``recv_ns``."""
        self.records += 1
        if not self.first_ns:
            self.first_ns = recv_ns
        event_id = next((v for k, v in headers or () if k == _HEADER), None)
        if event_id is None:
            self.no_id += 1
            return
        if event_id in self.seen:
            # A re-send (at-least-once): the first copy decided order and arrival time.
            self.duplicates += 1
            return
        self.seen.add(event_id)
        self.last_ns = recv_ns
        if framed(value):
            self.avro += 1
        if key is None:
            return
        self.keyed += 1
        try:
            seq = sequence(value)
        except (ValueError, TypeError, KeyError):
            self.unordered += 1
            return
        if seq < self.last_seq.get(key, -1):
            self.violations += 1
        else:
            self.last_seq[key] = seq

    def summary(self, expect: int) -> dict[str, Any]:
        """The tally as JSON (``complete``: every expected event arrived)."""
        return {
            "records": self.records,
            "unique": len(self.seen),
            "expect": expect,
            "complete": len(self.seen) >= expect,
            "duplicates": self.duplicates,
            "no_event_id": self.no_id,
            "first_ns": self.first_ns or None,
            "last_ns": self.last_ns or None,
            "keyed": self.keyed,
            "keys": len(self.last_seq),
            "order_violations": self.violations,
            "keyed_without_seq": self.unordered,
            "avro_records": self.avro,
        }


async def _wait(tally: Tally, fetch: asyncio.Task[None], cmd: dict[str, Any]) -> dict[str, Any]:
    expect = int(cmd["expect"])
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(float(cmd["timeout"])):
            while len(tally.seen) < expect and not fetch.done():
                tally.changed.clear()
                await tally.changed.wait()
    if fetch.done():
        fetch.result()  # raises the fetch error
    return tally.summary(expect)


async def run(bootstrap: str, topic: str) -> None:
    """Consume ``topic`` from the beginning and serve the line protocol until ``quit``."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        # What a consumer of the exactly-once mode must set; the same as read_uncommitted
        # for records written outside transactions (the other modes').
        isolation_level="read_committed",
        client_id="bench-tally",
        # Large fetches: the consumer shares 2 cores with what it measures, so it should not
        # be the bottleneck of a fast drain.
        max_partition_fetch_bytes=4 * 1024 * 1024,
        fetch_max_bytes=16 * 1024 * 1024,
    )
    async with asyncio.timeout(_START_TIMEOUT):
        await consumer.start()
    try:
        await assign_all(consumer, topic, from_end=False)
        tally = Tally()
        fetch = asyncio.create_task(
            fetch_loop(
                consumer,
                lambda r, recv: tally.add(r.key, r.value, r.headers, recv),
                max_records=5000,
                changed=tally.changed,
            )
        )
        # Wakes a waiting command when the fetch task dies, so its error is reported.
        fetch.add_done_callback(lambda _: tally.changed.set())
        await serve_lines(fetch, {"ready": True}, lambda cmd: _wait(tally, fetch, cmd))
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10):
                await consumer.stop()


def main(argv: list[str]) -> int:
    """Entry point of ``python -m bench _tally BOOTSTRAP TOPIC``."""
    from bench.procs import run_async

    run_async(run(argv[0], argv[1]))
    return 0
