"""Tools of the fault suite: the relay CLI as a subprocess with more ways to wait on it, access
to the restartable local stack, a TCP proxy that can make one connection go silent, a live
Kafka tail for recovery times, and bounded waits.

Every wait here has a timeout and a message; nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import anyio.abc
import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from devstack.relayproc import READY, RelayProcess, create_topics
from tests.support import header

if TYPE_CHECKING:
    from devstack import KafkaBroker, PostgresServer
    from tests.conftest import Services

# Settings for relays under test: quick reconnects, a short health probe and a long fallback
# poll, so that a recovery the suite measures comes from the mechanism under test (reconnect,
# catch-up, LISTEN) and not from the poll.
RELAY_ENV: dict[str, str] = {
    "NOTIFY_OUTBOX_RECONNECT_MIN_DELAY": "0.05",
    "NOTIFY_OUTBOX_RECONNECT_MAX_DELAY": "1",
    "NOTIFY_OUTBOX_LISTEN_HEALTH_INTERVAL": "2",
    "NOTIFY_OUTBOX_LISTEN_HEALTH_TIMEOUT": "2",
    "NOTIFY_OUTBOX_POLL_INTERVAL": "30",
    "NOTIFY_OUTBOX_KAFKA_SEND_TIMEOUT": "5",
    "NOTIFY_OUTBOX_SHUTDOWN_TIMEOUT": "15",
    "NOTIFY_OUTBOX_DB_COMMAND_TIMEOUT": "5",
    "NOTIFY_OUTBOX_WORKERS": "2",
    "NOTIFY_OUTBOX_BATCH_SIZE": "50",
}

LISTENER_APP = "notify-outbox-listener"
# I5: once faults heal, an event committed on an idle relay must arrive this fast. Far below
# the 30 s fallback poll of RELAY_ENV, so a lost wake-up mechanism cannot hide behind it.
LATENCY_BOUND = 5.0
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def max_in_flight(workers: int, batch_size: int) -> int:
    """The most rows one relay process can hold unmarked at a crash: every worker inside a
    claim of up to ``batch_size`` heads plus up to ``batch_size`` followers (sql/queries.sql)."""
    return workers * 2 * batch_size


# --- the local stack -------------------------------------------------------------------------


def restartable(services: Services) -> tuple[PostgresServer, KafkaBroker]:
    """The PostgreSQL and Kafka handles that can be stopped and restarted; fails the test
    (never skips) when the services came from elsewhere."""
    from devstack import KafkaBroker, PostgresServer

    if not isinstance(services.postgres, PostgresServer) or not isinstance(
        services.kafka, KafkaBroker
    ):
        pytest.fail(
            "this fault test stops and restarts PostgreSQL and Kafka, which needs the project's "
            "own local stack (devstack); these services came from NOTIFY_OUTBOX_TEST_DSN / "
            "NOTIFY_OUTBOX_TEST_BOOTSTRAP_SERVERS or from Docker. Unset those variables (and "
            "make `docker info` fail) to run the fault suite.",
            pytrace=False,
        )
    return services.postgres, services.kafka


async def run_blocking(fn: Callable[[], Any]) -> Any:
    """Run a blocking call (a service restart, a process wait) off the event loop, so that
    writers and consumers in the loop keep going meanwhile."""
    return await anyio.to_thread.run_sync(fn)


# --- waiting ----------------------------------------------------------------------------------


async def eventually(
    check: Callable[[], Awaitable[bool]],
    *,
    within: float,
    what: str,
    interval: float = 0.05,
    details: Callable[[], str] | None = None,
) -> float:
    """Poll ``check`` until it is true (for state that emits no event, such as a table's
    pending count); returns the seconds it took, fails the test after ``within`` seconds."""
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > within:
            extra = f"\n{details()}" if details is not None else ""
            pytest.fail(f"timed out after {within}s waiting until {what}{extra}", pytrace=False)
        await anyio.sleep(interval)
    return time.monotonic() - started


@contextlib.asynccontextmanager
async def task_group() -> AsyncIterator[anyio.abc.TaskGroup]:
    """anyio's task group, whose failure comes out as the first exception itself instead of
    (nested) exception groups: readable reports, and no deep recursion when pytest formats
    them (CPython 3.11 can crash with "AST constructor recursion depth mismatch" there)."""
    try:
        async with anyio.create_task_group() as tg:
            yield tg
    except BaseExceptionGroup as group:
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


@contextlib.asynccontextmanager
async def connect(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(dsn)
    try:
        yield conn
    finally:
        await conn.close()


async def fetchval(dsn: str, sql: str, *args: Any) -> Any:
    async with connect(dsn) as conn:
        return await conn.fetchval(sql, *args)


async def durable_commits(dsn: str) -> None:
    """The test stack runs with ``synchronous_commit = off`` for speed, so a crash-like
    PostgreSQL stop forgets the last commits, even ones a client saw succeed. Tests that stop
    PostgreSQL turn it back on for their database (every session opened after this)."""
    async with connect(dsn) as conn:
        name = await conn.fetchval("SELECT current_database()")
        await conn.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = on')


async def pending_rows(dsn: str) -> int:
    return int(await fetchval(dsn, "SELECT count(*) FROM outbox WHERE published_at IS NULL"))


def dsn_with_port(dsn: str, host: str, port: int) -> str:
    parts = urlsplit(dsn)
    auth = parts.netloc.rpartition("@")[0]
    netloc = f"{auth}@{host}:{port}" if auth else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


async def terminate_listeners(dsn: str, *, pick: int | None = None) -> int:
    """``pg_terminate_backend`` on the relays' listening connections of this database (all of
    them, or only the ``pick``-th by pid); returns how many were terminated."""
    async with connect(dsn) as conn:
        pids = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 "
            "AND datname = current_database() ORDER BY pid",
            LISTENER_APP,
        )
        chosen = [r["pid"] for r in pids]
        if pick is not None and chosen:
            chosen = [chosen[pick % len(chosen)]]
        killed = 0
        for pid in chosen:
            killed += bool(await conn.fetchval("SELECT pg_terminate_backend($1)", pid))
        return killed


async def listener_count(dsn: str) -> int:
    return int(
        await fetchval(
            dsn,
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
            "AND datname = current_database()",
            LISTENER_APP,
        )
    )


# --- the relay as a subprocess ----------------------------------------------------------------


def log_time(line: str) -> float:
    """Wall-clock time (epoch seconds) of a relay log line."""
    m = _LOG_TIME.match(line)
    if m is None:
        raise AssertionError(f"log line without a timestamp: {line!r}")
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


class FaultRelay(RelayProcess):
    """``python -m notify_outbox run`` as a subprocess (``devstack.relayproc.RelayProcess``),
    with fast fault-test settings, its in-flight bound, and async waits that keep the event
    loop free."""

    def __init__(
        self,
        dsn: str,
        bootstrap: str,
        *args: str,
        env: dict[str, str] | None = None,
        name: str = "relay",
    ) -> None:
        self.env = {**RELAY_ENV, **(env or {})}
        self.workers = int(self.env["NOTIFY_OUTBOX_WORKERS"])
        self.batch_size = int(self.env["NOTIFY_OUTBOX_BATCH_SIZE"])
        super().__init__(dsn, bootstrap, *args, env=self.env, name=name)

    @property
    def in_flight_bound(self) -> int:
        return max_in_flight(self.workers, self.batch_size)

    async def line(self, pattern: str, *, count: int = 1, within: float = 60.0) -> str:
        """Wait until ``pattern`` has been logged ``count`` times; returns that line."""
        return await anyio.to_thread.run_sync(
            lambda: self.wait_for_line(pattern, within, count=count)
        )

    async def ready(self, within: float = 60.0) -> None:
        await self.line(READY, within=within)

    async def exited(self, within: float) -> int:
        """Wait for the process to exit by itself; fails the test after ``within`` s."""
        try:
            return int(await anyio.to_thread.run_sync(lambda: self.wait(within)))
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} did not exit within {within}s:\n{self.output()}"
            ) from None

    async def terminate(self, within: float = 60.0) -> tuple[int, float]:
        """SIGTERM and wait; returns the exit code and the seconds the exit took."""
        started = time.monotonic()
        self.signal(signal.SIGTERM)
        code = await self.exited(within)
        return code, time.monotonic() - started

    async def stop_ok(self, within: float = 60.0) -> None:
        """Graceful stop that must exit 0."""
        code, _ = await self.terminate(within)
        assert code == 0, f"{self.name} exited {code} on SIGTERM:\n{self.output()}"

    async def kill(self) -> float:
        """SIGKILL (a crash); returns the wall-clock time of the kill."""
        at = time.time()
        self.proc.kill()
        await self.exited(30)
        return at

    def output(self, lines: int = 50) -> str:
        """The last lines of the relay's own log (aiokafka's reconnect chatter left out; the
        whole log is in ``dump()``)."""
        with self._cond:
            own = [line for line in self.lines if " aiokafka" not in line]
        return f"--- {self.name} (last lines, without aiokafka's) ---\n" + "\n".join(own[-lines:])

    def dump(self) -> Path:
        """Write the whole log to a file (for a failure's post-mortem); returns its path."""
        folder = Path(tempfile.gettempdir()) / "notify-outbox-faults"
        folder.mkdir(exist_ok=True)
        path = folder / f"{self.name}-{self.proc.pid}.log"
        with self._cond:
            path.write_text("\n".join(self.lines) + "\n")
        return path


@contextlib.asynccontextmanager
async def relays(*procs: FaultRelay) -> AsyncIterator[tuple[FaultRelay, ...]]:
    """Make sure every relay process is gone when the test ends, however it ends; on a
    failure, print their last log lines (pytest shows them with the failure)."""
    try:
        yield procs
    except BaseException:
        for p in procs:
            print(p.output())
            print(f"full log of {p.name}: {p.dump()}")
        raise
    finally:
        for p in procs:
            p.__exit__(None, None, None)


# --- topics ------------------------------------------------------------------------------------


async def create_topic_with_configs(
    bootstrap: str, name: str, configs: dict[str, str], *, partitions: int = 1
) -> None:
    """A topic with broker-side topic configs, such as a small ``max.message.bytes``: a limit
    the broker enforces when it appends, so a row over it fails at ack time, not at send."""
    await create_topics(bootstrap, [name], partitions=partitions, configs=configs)


# --- a Kafka tail: when did each event arrive? -----------------------------------------------


class KafkaTail:
    """A consumer reading the topics from the beginning in the background, noting the
    monotonic time at which each event id first arrived. Used to time recoveries; the
    invariant check uses a fresh consumer of its own."""

    def __init__(self, bootstrap: str, topics: Iterable[str]) -> None:
        self._bootstrap = bootstrap
        self._topics = list(topics)
        self.first_seen: dict[str, float] = {}
        self.messages = 0
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._consumer: AIOKafkaConsumer | None = None

    async def __aenter__(self) -> KafkaTail:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self._bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        await consumer.start()
        tps = await partitions(consumer, self._topics)
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        self._consumer = consumer
        self._task = asyncio.create_task(self._run(tps), name="kafka-tail")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            with anyio.move_on_after(10, shield=True):
                await self._consumer.stop()

    async def _run(self, tps: list[TopicPartition]) -> None:
        assert self._consumer is not None
        while True:
            try:
                batch = await self._consumer.getmany(*tps, timeout_ms=100)
            except Exception:
                await asyncio.sleep(0.2)
                continue
            now = time.monotonic()
            for records in batch.values():
                for record in records:
                    self.messages += 1
                    event_id = header(record, "outbox-event-id")
                    if event_id is not None:
                        self.first_seen.setdefault(event_id, now)
            if batch:
                self._changed.set()

    async def wait_for(self, event_ids: Iterable[str], *, within: float, what: str) -> float:
        """Wait until every id arrived; returns the monotonic time the last one arrived."""
        wanted = set(event_ids)
        with anyio.move_on_after(within):
            while not wanted <= self.first_seen.keys():
                self._changed.clear()
                await self._changed.wait()
            return max(self.first_seen[e] for e in wanted)
        missing = len(wanted - self.first_seen.keys())
        raise AssertionError(f"{missing} event(s) not in Kafka within {within}s: {what}")


async def idle_latency(
    dsn: str, produce: Callable[[], Awaitable[str]], tail: KafkaTail, *, what: str
) -> float:
    """I5: wait until the backlog is drained (the relay goes idle), commit one event, and
    require it in Kafka within ``LATENCY_BOUND``: proves that wake-ups work again."""
    await eventually(
        lambda: _no_pending(dsn), within=60, what=f"the backlog drained ({what})", interval=0.1
    )
    started = time.monotonic()
    event_id = await produce()
    arrived = await tail.wait_for(
        [event_id],
        within=LATENCY_BOUND,
        what=f"an event committed on an idle relay ({what}): no wake-up reached the relay",
    )
    return arrived - started


async def _no_pending(dsn: str) -> bool:
    return await pending_rows(dsn) == 0


async def partitions(consumer: AIOKafkaConsumer, topics: Iterable[str]) -> list[TopicPartition]:
    tps: list[TopicPartition] = []
    for topic in topics:

        async def known(topic: str = topic) -> bool:
            # Right after a broker restart (an earlier test's), metadata can lag: ask again.
            if not consumer.partitions_for_topic(topic):
                await consumer._client.force_metadata_update()
            return bool(consumer.partitions_for_topic(topic))

        await eventually(known, within=30, what=f"topic {topic} has partitions", interval=0.2)
        tps.extend(TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic)))
    return tps


# --- a proxy that can make one connection silently dead --------------------------------------


# PostgreSQL's ReadyForQuery message while idle: the end of a connection's start-up.
_READY_FOR_QUERY = b"Z\x00\x00\x00\x05I"


@dataclass
class _Link:
    upstream_port: int
    silent: bool = False
    armed: bool = False  # go silent right after the server's first ReadyForQuery
    startup: bytes = b""
    # When the first byte from the client was swallowed (epoch seconds): when the client
    # began a statement that can never be answered.
    swallowed_at: float | None = None


class SilentProxy:
    """A loopback TCP proxy to PostgreSQL. ``silence(port)`` makes the proxied connection
    whose upstream socket has that local port (PostgreSQL's ``client_port``) swallow every
    byte in both directions without closing anything: no FIN, no RST, like a peer behind a
    dead NAT entry. Runs its own event loop in a thread, so blocking test code cannot stall
    it."""

    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._links: dict[int, _Link] = {}
        self._writers: set[asyncio.StreamWriter] = set()
        self._arm_match: bytes | None = None
        self.silenced_at_startup: list[int] = []
        self.port = 0

    def __enter__(self) -> SilentProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop
        ).result(10)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def __exit__(self, *exc: object) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                w.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def silence(self, upstream_port: int) -> None:
        def flip() -> None:
            link = self._links.get(upstream_port)
            if link is None:
                raise AssertionError(f"no proxied connection with upstream port {upstream_port}")
            link.silent = True

        async def run() -> None:
            flip()

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def upstream_ports(self) -> list[int]:
        """The upstream local ports of every connection proxied so far (PostgreSQL's
        ``client_port``): which server sessions are the proxied client's."""

        async def run() -> list[int]:
            return list(self._links)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def first_swallowed(self, upstream_ports: Iterable[int]) -> float | None:
        """When the proxy first swallowed a byte that the client sent on one of these silenced
        connections (epoch seconds; None: the client sent nothing since)."""

        async def run() -> float | None:
            times = [
                link.swallowed_at
                for port in upstream_ports
                if (link := self._links.get(port)) is not None and link.swallowed_at is not None
            ]
            return min(times, default=None)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def silence_next(self, match: bytes) -> None:
        """Make the next connection whose start-up packet contains ``match`` (such as an
        ``application_name``) go silent as soon as its start-up completes: the client's
        first statements after connecting vanish."""

        async def run() -> None:
            self._arm_match = match

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            ureader, uwriter = await asyncio.open_connection(*self._upstream)
        except OSError:
            cwriter.close()
            return
        link = _Link(int(uwriter.get_extra_info("sockname")[1]))
        self._links[link.upstream_port] = link
        self._writers.update((cwriter, uwriter))
        await asyncio.gather(
            self._pipe(creader, uwriter, link),
            self._pipe(ureader, cwriter, link),
            return_exceptions=True,
        )

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link
    ) -> None:
        upstream = writer.get_extra_info("sockname")[1] == link.upstream_port
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if link.silent:
                    if upstream and link.swallowed_at is None:
                        link.swallowed_at = time.time()
                    continue  # swallowed: the peer never hears of it
                if upstream and self._arm_match is not None and len(link.startup) < 4096:
                    link.startup += data
                    if self._arm_match in link.startup:
                        link.armed, self._arm_match = True, None
                writer.write(data)
                await writer.drain()
                if not upstream and link.armed and _READY_FOR_QUERY in data:
                    link.silent = True
                    self.silenced_at_startup.append(link.upstream_port)
        # One side closed. On a live link, close the other side too. On a silent link the
        # close is swallowed like everything else: the server keeps its backend (and any
        # session-level lock it holds) until the proxy shuts down, as it would behind a dead
        # network path.
        if not link.silent:
            writer.close()
            self._writers.discard(writer)
