"""The load generator, run as its own process (``python -m bench _loadgen CONFIG``).

Open loop: the send schedule (constant rate, or Poisson) is fixed before the first event, and
``writers`` connections take the events in schedule order, never skipping one; each event is a
single-row transaction (plain SQL, or ``notify_outbox.enqueue``), or with ``tx_events`` N > 1 up
to N due events per transaction. The payload carries the cell, the event's index and its
scheduled ``time.monotonic_ns()`` (one clock for the host), so latency counts from the schedule
(no coordinated omission); per event the send start and commit ack are recorded too.
``reconnect``: a broken connection is opened again before the next event (failed events are
errors, not retried). ``stop_on_input``: a line on stdin ends the schedule. ``announce``: prints
``{"t0": ...}`` before the first event. ``sink: "kafka"``: no database, the relay's own producer
sends straight to the topic (the Kafka floor). ``closed``: as fast as possible for ``duration``
(producer overhead without pgbench). ``tables``: each event into one of these outbox tables,
picked at random (seeded), instead of ``outbox`` (single-row transactions only)."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import uuid
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from bench.arrays import new_array, save_arrays
from bench.hist import Histogram

SQL_INSERT = "INSERT INTO outbox (topic, key, payload) VALUES ($1, $2, $3::jsonb)"
SQL_INSERT_MANY = (
    "INSERT INTO outbox (topic, key, payload) "
    "SELECT $1, k, p::jsonb FROM unnest($2::text[], $3::text[]) AS e(k, p)"
)
_CONNECT_TIMEOUT = 15.0
_START_DELAY_NS = 300_000_000  # the schedule starts this long after every writer connected
_FLUSH_TIMEOUT = 30.0  # the floor: how long the last sends' acks may take after the schedule


@dataclass
class LoadConfig:
    """What one generator run does (written as JSON by the orchestrator)."""

    dsn: str
    topic: str
    cell: int
    rate: float  # events per second (open loop)
    warmup: float  # seconds at the offered rate before the measured window
    duration: float  # seconds of the measured window (closed loop: of the run)
    writers: int
    out: str  # where the per-event arrays go
    producer: str = "sql"  # "sql" or "enqueue"
    arrival: str = "constant"  # "constant" or "poisson"
    keys: int = 1000
    seed: int = 1
    grace: float = 5.0  # events not started this long after the schedule ends are dropped
    closed: bool = False
    tx_events: int = 1  # up to this many already-due events per transaction
    reconnect: bool = False  # open loop: reconnect a writer whose connection broke
    stop_on_input: bool = False  # open loop: a line (or EOF) on stdin ends the schedule
    announce: bool = False  # open loop: print {"t0": ...} on stdout when the schedule is fixed
    sink: str = "postgres"  # "postgres": INSERT into the outbox; "kafka": the floor (no database)
    bootstrap: str = ""  # Kafka's bootstrap servers, for the "kafka" sink
    tables: tuple[str, ...] = ()  # e.g. ("t000.outbox", ...): a random one per event
    # More databases: a table named "i:schema.table" is in dsns[i] (each writer connects to
    # every one of them); plain "schema.table" names are in dsn.
    dsns: tuple[str, ...] = ()

    @classmethod
    def load(cls, path: Path) -> LoadConfig:
        """Read a config written by ``save``."""
        data = json.loads(path.read_text())
        return cls(
            **{
                **data,
                "tables": tuple(data.get("tables", ())),
                "dsns": tuple(data.get("dsns", ())),
            }
        )

    def save(self, path: Path) -> None:
        """Write this config as JSON."""
        path.write_text(json.dumps(asdict(self)))


def build_schedule(rate: float, seconds: float, arrival: str, seed: int, t0: int) -> array[int]:
    """Scheduled send times (monotonic ns) of every event in ``seconds`` from ``t0``."""
    sched: array[int] = array("q")
    end = t0 + int(seconds * 1e9)
    if arrival == "constant":
        n = round(rate * seconds)
        step = 1e9 / rate
        sched.extend(t0 + int(i * step) for i in range(n))
    elif arrival == "poisson":
        rng = random.Random(seed)
        t = float(t0)
        while True:
            t += rng.expovariate(rate) * 1e9
            if t >= end:
                break
            sched.append(int(t))
    else:
        raise ValueError(f"unknown arrival process {arrival!r}")
    return sched


def event_key(cfg: LoadConfig, i: int) -> str:
    """The key of event ``i``: ``cfg.keys`` values, round robin."""
    return f"k{i % cfg.keys}"


def event_payload(cfg: LoadConfig, i: int, sched_ns: int) -> str:
    """The JSON payload of event ``i``: its cell, index and scheduled time."""
    return f'{{"c":{cfg.cell},"i":{i},"t":{sched_ns}}}'


class _KafkaSink:
    """The floor's sink: one producer for every writer, as the relay has one per process."""

    def __init__(self, cfg: LoadConfig, producer: AIOKafkaProducer) -> None:
        self.cfg = cfg
        self.producer = producer
        self.pending: set[asyncio.Future[Any]] = set()
        self.errors: list[str] = []

    @classmethod
    async def start(cls, cfg: LoadConfig) -> _KafkaSink:
        """The relay's own producer (its settings' defaults), started, with the topic's
        metadata in hand: the first send must not wait for it."""
        from notify_outbox.core.settings import OutboxSettings
        from notify_outbox.kafka.publisher import KafkaPublisher

        settings = OutboxSettings.model_validate(
            {
                "dsn": "postgresql://floor.invalid/none",  # required, never used: no database
                "kafka_bootstrap_servers": cfg.bootstrap,
                "kafka_client_id": "bench-floor",
            }
        )
        producer = KafkaPublisher(settings)._make_producer()
        async with asyncio.timeout(_CONNECT_TIMEOUT):
            await producer.start()
            await producer.partitions_for(cfg.topic)
        return cls(cfg, producer)

    async def send(self, idx: list[int], sched_ns: list[int]) -> None:
        """Hand events ``idx`` to the producer (their acks come later, in the background)."""
        for i, t in zip(idx, sched_ns, strict=True):
            fut = await self.producer.send(
                self.cfg.topic,
                value=event_payload(self.cfg, i, t).encode(),
                key=event_key(self.cfg, i).encode(),
                # The relay's records carry their event id: the same bytes on the wire.
                headers=[("outbox-event-id", str(uuid.uuid4()).encode())],
            )
            self.pending.add(fut)
            fut.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future[Any]) -> None:
        self.pending.discard(fut)
        if not fut.cancelled() and (e := fut.exception()) is not None:
            self.errors.append(f"{type(e).__name__}: {e}")

    async def close(self) -> None:
        """Wait (bounded) for the acks still out, then stop the producer."""
        if self.pending:
            await asyncio.wait(set(self.pending), timeout=_FLUSH_TIMEOUT)
        if self.pending:
            self.errors.append(f"{len(self.pending)} sends without an ack at the end")
        async with asyncio.timeout(_FLUSH_TIMEOUT):
            await self.producer.stop()


async def _connect_all(cfg: LoadConfig) -> list[Any]:
    """A connection per writer; with ``dsns``, a list per writer: one to each database."""
    if cfg.producer == "enqueue":
        import notify_outbox  # noqa: F401  (a slow first import must not stall the schedule)
    elif cfg.producer != "sql":
        raise ValueError(f"unknown producer {cfg.producer!r}")

    def connect(dsn: str) -> Any:
        return asyncpg.connect(
            dsn, timeout=_CONNECT_TIMEOUT, server_settings={"application_name": "bench-loadgen"}
        )

    if cfg.dsns:
        if cfg.reconnect or not cfg.tables:
            raise ValueError("dsns: with tables, and no reconnect")
        return [
            list(await asyncio.gather(*(connect(d) for d in cfg.dsns))) for _ in range(cfg.writers)
        ]
    return list(await asyncio.gather(*(connect(cfg.dsn) for _ in range(cfg.writers))))


def _table_places(cfg: LoadConfig) -> list[tuple[int, str]]:
    """Each of ``tables`` as (index into ``dsns``, or -1 for ``dsn``; ``schema.table``)."""
    out = []
    for t in cfg.tables:
        db, sep, name = t.partition(":")
        out.append((int(db), name) if sep else (-1, t))
    return out


async def _insert_many(
    cfg: LoadConfig, conn: asyncpg.Connection, idx: list[int], sched_ns: list[int]
) -> None:
    """Events ``idx`` in one transaction (one autocommit statement for plain SQL)."""
    keys = [event_key(cfg, i) for i in idx]
    if cfg.producer == "sql":
        payloads = [event_payload(cfg, i, t) for i, t in zip(idx, sched_ns, strict=True)]
        if len(idx) == 1:
            await conn.execute(SQL_INSERT, cfg.topic, keys[0], payloads[0])
        else:
            await conn.execute(SQL_INSERT_MANY, cfg.topic, keys, payloads)
        return
    from notify_outbox import OutboxEvent, enqueue_many  # imported early by _connect_all

    async with conn.transaction():
        await enqueue_many(
            conn,
            [
                OutboxEvent(topic=cfg.topic, key=k, payload={"c": cfg.cell, "i": i, "t": t})
                for k, i, t in zip(keys, idx, sched_ns, strict=True)
            ],
        )


async def run_open(cfg: LoadConfig) -> dict[str, Any]:
    """Run the open-loop schedule; write the arrays; return a summary."""
    if cfg.sink not in ("postgres", "kafka"):
        raise ValueError(f"unknown sink {cfg.sink!r}")
    kafka = await _KafkaSink.start(cfg) if cfg.sink == "kafka" else None
    conns: list[Any] = [kafka] * cfg.writers if kafka is not None else await _connect_all(cfg)
    t0 = time.monotonic_ns() + _START_DELAY_NS
    sched = build_schedule(cfg.rate, cfg.warmup + cfg.duration, cfg.arrival, cfg.seed, t0)
    if cfg.announce:  # the orchestrator times its own steps from the schedule's start
        sys.stdout.write(json.dumps({"t0": t0}) + "\n")
        sys.stdout.flush()
    n = len(sched)
    if cfg.tables and cfg.tx_events != 1:
        raise ValueError("tables: single-row transactions only")
    rng = random.Random(cfg.seed)
    table_of = [rng.randrange(len(cfg.tables)) for _ in range(n)] if cfg.tables else []
    send = new_array(n)
    ack = new_array(n)
    window_start = t0 + int(cfg.warmup * 1e9)
    window_end = t0 + int((cfg.warmup + cfg.duration) * 1e9)
    give_up = window_end + int(cfg.grace * 1e9)
    next_i = 0
    errors: list[str] = []
    reconnects = 0
    stopped_at: int | None = None
    # Every connection, reconnects included, is closed at the end (the floor has none).
    opened = [] if kafka is not None else [c for w in conns for c in (w if cfg.dsns else [w])]
    places = _table_places(cfg)

    async def writer(conn: Any) -> None:
        nonlocal next_i, reconnects
        while next_i < n:
            if cfg.reconnect and conn.is_closed():
                try:
                    conn = await asyncpg.connect(
                        cfg.dsn,
                        timeout=_CONNECT_TIMEOUT,
                        server_settings={"application_name": "bench-loadgen"},
                    )
                    opened.append(conn)
                    reconnects += 1
                except (asyncpg.PostgresError, OSError, asyncpg.InterfaceError, TimeoutError):
                    # The server is still down: this writer's next due event fails below (and
                    # counts as an error) instead of the writer falling behind the schedule.
                    pass
            i = next_i
            next_i += 1
            due = sched[i]
            now = time.monotonic_ns()
            if due > now:
                await asyncio.sleep((due - now) / 1e9)
                now = time.monotonic_ns()
            if now > give_up:
                next_i = n  # far behind the schedule: stop; the rest count as unsent
                return
            group = [i]
            while len(group) < cfg.tx_events and next_i < n and sched[next_i] <= now:
                group.append(next_i)
                next_i += 1
            for j in group:
                send[j] = now
            try:
                if kafka is not None:
                    await kafka.send(group, [sched[j] for j in group])
                elif cfg.tables:
                    db, table = places[table_of[i]]
                    await (conn[db] if db >= 0 else conn).execute(
                        SQL_INSERT.replace("outbox", table, 1),
                        cfg.topic,
                        event_key(cfg, i),
                        event_payload(cfg, i, sched[i]),
                    )
                else:
                    await _insert_many(cfg, conn, group, [sched[j] for j in group])
            except (
                asyncpg.PostgresError,
                OSError,
                asyncpg.InterfaceError,
                asyncpg.InternalClientError,
                KafkaError,
            ) as e:
                errors.append(f"{type(e).__name__}: {e}")
                if cfg.reconnect and isinstance(e, asyncpg.InternalClientError):
                    # asyncpg's protocol state is broken after the server went away mid-query:
                    # drop the connection so that the next event reconnects.
                    conn.terminate()
                continue
            acked = time.monotonic_ns()
            for j in group:
                ack[j] = acked

    async def stop_on_input() -> None:
        nonlocal next_i, stopped_at
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        await reader.readline()
        stopped_at = min(next_i, n)
        next_i = n

    stopper = asyncio.create_task(stop_on_input()) if cfg.stop_on_input else None
    try:
        await asyncio.gather(*(writer(c) for c in conns))
    finally:
        if stopper is not None:
            stopper.cancel()
        if kafka is not None:
            await kafka.close()
            errors += kafka.errors  # acks that failed: those events count as missing too
        await asyncio.gather(*(c.close(timeout=5) for c in opened), return_exceptions=True)
    save_arrays(Path(cfg.out), {"sched": sched, "send": send, "ack": ack})
    return {
        "events": n,
        "sent": sum(1 for v in send if v),
        "acked": sum(1 for v in ack if v),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "reconnects": reconnects,
        "stopped_at": stopped_at,
        "t0": t0,
        "window_start": window_start,
        "window_end": window_end,
    }


async def run_closed(cfg: LoadConfig) -> dict[str, Any]:
    """Insert as fast as possible on every connection for ``duration`` seconds."""
    conns = await _connect_all(cfg)
    hist = Histogram()
    errors: list[str] = []
    counter = 0
    start = time.monotonic_ns() + _START_DELAY_NS
    end = start + int(cfg.duration * 1e9)

    async def writer(conn: asyncpg.Connection) -> None:
        nonlocal counter
        delay = (start - time.monotonic_ns()) / 1e9
        if delay > 0:
            await asyncio.sleep(delay)
        while True:
            t = time.monotonic_ns()
            if t >= end:
                return
            i = counter
            counter += 1
            try:
                await _insert_many(cfg, conn, [i], [t])
            except (asyncpg.PostgresError, OSError, asyncpg.InterfaceError) as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            hist.record((time.monotonic_ns() - t) // 1000)

    try:
        await asyncio.gather(*(writer(c) for c in conns))
        elapsed = (time.monotonic_ns() - start) / 1e9
    finally:
        await asyncio.gather(*(c.close(timeout=5) for c in conns), return_exceptions=True)
    return {
        "commits": hist.count,
        "elapsed": elapsed,
        "commits_per_s": hist.count / elapsed if elapsed > 0 else 0.0,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "latency": hist.to_json(),
    }


def main(argv: list[str]) -> int:
    """Entry point of ``python -m bench _loadgen CONFIG.json``: prints a JSON summary."""
    cfg = LoadConfig.load(Path(argv[0]))
    from bench.procs import run_async

    summary = run_async(run_closed(cfg) if cfg.closed else run_open(cfg))
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0
