"""The consumer, run as its own process (``python -m bench _consumer TOPIC``).

It reads every partition of one topic from its end, and stamps each record with
``time.monotonic_ns()`` the moment a fetch hands it over. Records are grouped by the cell number
in their payload. A line protocol on stdin/stdout lets the orchestrator collect one cell:

    -> {"ready": true, "wall_offset_ns": ...}                      once positioned
    <- {"cmd": "collect", "cell": 3, "expect": 5000, "timeout": 15, "out": "/path"}
    -> {"cell": 3, "received": 5000, "duplicates": 0, "late": 0}   arrays written to /path
    <- {"cmd": "quit"}

The arrays are ``index`` (the event's index in its cell's schedule), ``recv`` (monotonic ns)
and ``kafka_ts`` (the record's CreateTime, stamped by the publishing producer at ``send()``,
converted to the monotonic clock: millisecond resolution, so the midpoint of its millisecond).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import time
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.arrays import save_arrays

_START_TIMEOUT = 30.0


def wall_offset_ns() -> int:
    """``time.time_ns() - time.monotonic_ns()`` (median of a few reads)."""
    samples = []
    for _ in range(9):
        a = time.monotonic_ns()
        w = time.time_ns()
        b = time.monotonic_ns()
        samples.append(w - (a + b) // 2)
    return int(statistics.median(samples))


async def assign_all(
    consumer: AIOKafkaConsumer, topic: str, *, from_end: bool
) -> list[TopicPartition]:
    """Assign every partition of ``topic`` (waiting, bounded, for its metadata) and position
    the consumer at the end (or the beginning) of each, resolved before this returns."""
    async with asyncio.timeout(_START_TIMEOUT):
        partitions = consumer.partitions_for_topic(topic)
        while not partitions:
            await consumer._client.force_metadata_update()
            partitions = consumer.partitions_for_topic(topic)
            if not partitions:
                await asyncio.sleep(0.1)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        if from_end:
            await consumer.seek_to_end(*tps)
        else:
            await consumer.seek_to_beginning(*tps)
        for tp in tps:  # resolve the positions now, before any event is written
            await consumer.position(tp)
    return tps


@dataclass
class _Cell:
    index: array[int] = field(default_factory=lambda: array("q"))
    recv: array[int] = field(default_factory=lambda: array("q"))
    kafka_ts: array[int] = field(default_factory=lambda: array("q"))
    seen: set[int] = field(default_factory=set)
    duplicates: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class _State:
    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.cells: dict[int, _Cell] = {}
        self.collected: set[int] = set()
        self.late = 0
        self.foreign = 0

    def cell(self, c: int) -> _Cell:
        cell = self.cells.get(c)
        if cell is None:
            cell = self.cells[c] = _Cell()
        return cell

    def add(self, value: bytes | None, ts_ms: int, recv: int) -> None:
        try:
            data = json.loads(value or b"")
            c, i = int(data["c"]), int(data["i"])
        except (ValueError, TypeError, KeyError):
            self.foreign += 1
            return
        if c in self.collected:
            self.late += 1
            return
        cell = self.cell(c)
        if i in cell.seen:
            cell.duplicates += 1
            return
        cell.seen.add(i)
        cell.index.append(i)
        cell.recv.append(recv)
        cell.kafka_ts.append(ts_ms * 1_000_000 + 500_000 - self.offset)
        cell.changed.set()


async def fetch_loop(
    consumer: AIOKafkaConsumer,
    add: Callable[[Any, int], None],
    *,
    max_records: int | None = None,
    changed: asyncio.Event | None = None,
) -> None:
    """Fetch until cancelled: ``add(record, receipt)`` for every record, the receipt being the
    monotonic time its fetch handed it over; ``changed`` set after every batch."""
    while True:
        batch = await consumer.getmany(timeout_ms=200, max_records=max_records)
        recv = time.monotonic_ns()
        for records in batch.values():
            for r in records:
                add(r, recv)
        if batch and changed is not None:
            changed.set()


async def _collect(state: _State, cmd: dict[str, Any]) -> dict[str, Any]:
    c = int(cmd["cell"])
    expect = int(cmd["expect"])
    cell = state.cell(c)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(float(cmd["timeout"])):
            while len(cell.index) < expect:
                cell.changed.clear()
                await cell.changed.wait()
    state.collected.add(c)
    del state.cells[c]
    save_arrays(
        Path(cmd["out"]), {"index": cell.index, "recv": cell.recv, "kafka_ts": cell.kafka_ts}
    )
    return {
        "cell": c,
        "received": len(cell.index),
        "duplicates": cell.duplicates,
        "late": state.late,
        "foreign": state.foreign,
    }


async def serve_lines(
    fetch: asyncio.Task[None],
    ready: dict[str, Any],
    answer: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
) -> None:
    """The line protocol of the bench's consumer processes: print ``ready``, then answer each
    JSON command read from stdin with one JSON line until ``quit`` or end of input; finally
    stop the ``fetch`` task."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps(ready), flush=True)
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd.get("cmd") == "quit":
                return
            print(json.dumps(await answer(cmd)), flush=True)
    finally:
        fetch.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await fetch


async def run(bootstrap: str, topic: str) -> None:
    """Consume ``topic`` and serve the line protocol until ``quit`` or end of input."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        # What a consumer of the exactly-once mode must set; the same as read_uncommitted
        # for records written outside transactions (the other modes').
        isolation_level="read_committed",
        auto_offset_reset="latest",
        client_id="bench-consumer",
    )
    async with asyncio.timeout(_START_TIMEOUT):
        await consumer.start()
    try:
        await assign_all(consumer, topic, from_end=True)
        state = _State(wall_offset_ns())
        fetch = asyncio.create_task(
            fetch_loop(consumer, lambda r, recv: state.add(r.value, r.timestamp, recv))
        )

        async def answer(cmd: dict[str, Any]) -> dict[str, Any]:
            if fetch.done():
                fetch.result()  # raises the fetch error
            return await _collect(state, cmd)

        await serve_lines(fetch, {"ready": True, "wall_offset_ns": state.offset}, answer)
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10):
                await consumer.stop()


def main(argv: list[str]) -> int:
    """Entry point of ``python -m bench _consumer BOOTSTRAP TOPIC``."""
    from bench.procs import run_async

    run_async(run(argv[0], argv[1]))
    return 0
