"""PostgreSQL fails over, or turns read-only, under a running relay.

Scenarios: 25 the primary stops and its streaming standby is promoted (the relay's DSN lists
both hosts with ``target_session_attrs=read-write``; 25b: the relay's DSN names the standby,
which refuses LISTEN until it is promoted); 26 the relay's server becomes read-only
for new transactions (``default_transaction_read_only``, as a demoted primary is): the relay
must leave its sessions and retry at the reconnect cadence, not sit in the 30 s backoff of a
failing statement.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import asyncpg
import pytest

from notify_outbox import OutboxNames, migrate
from tests.conftest import Services
from tests.faults.checker import FIGURES, OutboxChecker
from tests.faults.harness import (
    FaultRelay,
    KafkaTail,
    connect,
    eventually,
    fetchval,
    idle_latency,
    relays,
    run_blocking,
    task_group,
)
from tests.support import dsn_with_database

if TYPE_CHECKING:
    from devstack import PostgresServer, PostgresStandby

pytestmark = pytest.mark.anyio

DATABASE = "failover"


@pytest.fixture
def replicated(
    service_dir: Callable[[str], Path],
) -> Iterator[tuple[PostgresServer, PostgresStandby]]:
    """A primary and its streaming standby of this test's own (the test stops the primary,
    so not the session's cluster), built from the local PostgreSQL binaries."""
    from devstack import PostgresServer, PostgresStandby, StackError

    base = service_dir("failover")
    primary = PostgresServer(base / "primary", durable=False)
    standby = PostgresStandby(base / "standby", primary)
    try:
        try:
            primary.start()
            standby.start()
        except StackError as e:
            pytest.fail(f"no primary and standby for the failover test: {e}", pytrace=False)
        yield primary, standby
    finally:
        for server in (standby, primary):
            server.stop(mode="immediate")


def multi_host_dsn(database: str, *servers: PostgresServer) -> str:
    """One DSN listing every server, which connects to whichever takes writes."""
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"


async def test_25_failover_to_a_promoted_standby(
    replicated: tuple[PostgresServer, PostgresStandby], services: Services, topic: str
) -> None:
    """Writers insert keyed events; the primary stops (fast: it waits until its standby has
    all of its WAL), the standby is promoted and the writers move to it. The relay, whose DSN
    lists both hosts with target_session_attrs=read-write, finds the new primary by itself:
    nothing committed is lost, per-key order holds, only rows in flight at the stop repeat,
    and wake-ups (LISTEN) work on the new primary."""
    primary, standby = replicated
    await _outbox_database(primary)
    both = multi_host_dsn(DATABASE, primary, standby)
    checker = await OutboxChecker(both, services.bootstrap, [topic], "25 failover").setup()
    checker.expect_writer_errors()
    # The application's own DSN names the primary; it is pointed at the new one below.
    load = checker.writers(
        dsn=dsn_with_database(primary.dsn, DATABASE), writers=3, keys=20, pause=0.01
    )
    async with (
        relays(FaultRelay(both, services.bootstrap)) as (relay,),
        KafkaTail(services.bootstrap, [topic]) as tail,
        connect(standby.dsn) as on_standby,
        task_group() as tg,
    ):
        await relay.ready()
        tg.start_soon(load.run)
        await eventually(
            lambda: _at_least(tail.messages, 150), within=60, what="events flow to Kafka"
        )
        # A standby that is not connected at the stop would miss the last commits.
        await eventually(
            lambda: _streaming(primary.dsn), within=30, what="the standby streams from the primary"
        )
        tried = await _sessions(on_standby, DATABASE)
        await run_blocking(lambda: primary.stop(mode="fast"))
        # Until the promotion the relay's reconnects find no primary: each one tries the
        # standby (a session there) and passes over it, since it is read-only.
        await eventually(
            lambda: _grows(on_standby, DATABASE, tried + 3),
            within=30,
            what="the relay tries the standby while it is read-only",
        )
        await run_blocking(standby.promote)
        load.dsn = dsn_with_database(standby.dsn, DATABASE)
        healed = time.monotonic()
        checker.allow_duplicates(relay.in_flight_bound, "failover: rows in flight at the stop")
        async with checker.producer() as p:
            marker = await p.produce("marker")
        arrived = await tail.wait_for([marker], within=60, what="an event after the failover")
        FIGURES.recovery("failover", arrived - healed)
        await relay.line("listening again", within=30)
        produced = load.produced
        await eventually(
            lambda: _at_least(load.produced, produced + 150),
            within=60,
            what="the writers commit on the new primary",
        )
        await load.halt()
        async with checker.producer() as p:
            await idle_latency(both, lambda: p.produce("idle"), tail, what="after the failover")
        report = await checker.drain_and_check(within=90)
        await relay.stop_ok()
    print(report.text())
    assert sum(load.ledger.errors.values()) > 0, "the writers never noticed the failover"
    assert not relay.matching("read-only"), "target_session_attrs=read-write avoids the standby"
    report.assert_ok()


async def test_25b_a_relay_on_a_standby_waits_quietly_for_its_promotion(
    replicated: tuple[PostgresServer, PostgresStandby], services: Services, topic: str
) -> None:
    """A relay whose DSN names a hot standby (as a demoted primary is): LISTEN is refused
    with SQLSTATE 25006, and the listener retries at the reconnect cadence, saying so once.
    Once the standby is promoted, the relay listens and delivers."""
    primary, standby = replicated
    await _outbox_database(primary)
    both = multi_host_dsn(DATABASE, primary, standby)
    checker = await OutboxChecker(both, services.bootstrap, [topic], "25b standby").setup()
    async with connect(primary.dsn) as on_primary, connect(standby.dsn) as on_standby:
        # The relay checks the schema at start: the standby must have replayed it.
        lsn = await on_primary.fetchval("SELECT pg_current_wal_lsn()")
        await eventually(
            lambda: _replayed(on_standby, lsn), within=30, what="the standby has the schema"
        )
        on_the_standby = dsn_with_database(standby.dsn, DATABASE)
        async with (
            relays(FaultRelay(on_the_standby, services.bootstrap)) as (relay,),
            KafkaTail(services.bootstrap, [topic]) as tail,
        ):
            await relay.line("listener's server is a read-only standby", within=60)
            tried = await _sessions(on_standby, DATABASE)
            await eventually(
                lambda: _grows(on_standby, DATABASE, tried + 5),
                within=30,
                what="the listener tries again and again",
            )
            await run_blocking(lambda: primary.stop(mode="fast"))
            await run_blocking(standby.promote)
            await relay.ready(within=30)
            async with checker.producer() as p:
                event = await p.produce("after")
            await tail.wait_for([event], within=30, what="an event after the promotion")
            report = await checker.drain_and_check(within=60)
            await relay.stop_ok()
    print(report.text())
    # One line for all the refusals.
    assert len(relay.matching("read-only")) == 1, relay.output()
    report.assert_ok()


async def _outbox_database(primary: PostgresServer) -> None:
    async with connect(primary.dsn) as admin:
        await admin.execute(f"CREATE DATABASE {DATABASE}")
    async with connect(dsn_with_database(primary.dsn, DATABASE)) as conn:
        await migrate(conn, OutboxNames())


async def _replayed(conn: asyncpg.Connection, lsn: str) -> bool:
    return bool(await conn.fetchval("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn", lsn))


async def _at_least(value: int, target: int) -> bool:
    return value >= target


async def _streaming(dsn: str) -> bool:
    state = await fetchval(dsn, "SELECT state FROM pg_stat_replication")
    return bool(state == "streaming")


@contextlib.asynccontextmanager
async def read_only_for_new_transactions(dsn: str) -> AsyncIterator[None]:
    """The whole server defaults to read-only transactions (as a demoted primary refuses
    writes) until the block ends, in every session, existing ones included; reset after."""
    async with connect(dsn) as admin:
        await admin.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        await admin.execute("SELECT pg_reload_conf()")
        try:
            await eventually(
                lambda: _setting(dsn, "default_transaction_read_only", "on"),
                within=10,
                what="the server defaults to read-only transactions",
            )
            yield
        finally:
            await admin.execute("ALTER SYSTEM RESET default_transaction_read_only")
            await admin.execute("SELECT pg_reload_conf()")


async def _setting(dsn: str, name: str, value: str) -> bool:
    return bool(await fetchval(dsn, "SELECT current_setting($1) = $2", name, value))


async def _sessions(conn: asyncpg.Connection, database: str | None = None) -> int:
    """Sessions ever opened to ``database`` (default: the connection's) on the server of
    ``conn`` (pg_stat_database counts them as they end)."""
    sql = "SELECT sessions FROM pg_stat_database WHERE datname = coalesce($1, current_database())"
    return int(await conn.fetchval(sql, database) or 0)


async def test_26_a_read_only_server_is_left_at_the_reconnect_cadence(
    db_dsn: str, services: Services, topic: str
) -> None:
    """The relay's server turns read-only for new transactions while events wait (committed
    by a session that overrides the default, as a writer that reached the server before the
    switch would). Every claim fails with SQLSTATE 25006; the workers end those sessions and
    retry at the reconnect cadence (connection churn on the server), the relay says so once,
    and once the server is writable again the waiting events arrive at once."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "26 read-only").setup()
    writable = f"{db_dsn}?default_transaction_read_only=off"  # a start-up setting of asyncpg
    async with (
        relays(FaultRelay(db_dsn, services.bootstrap)) as (relay,),
        KafkaTail(services.bootstrap, [topic]) as tail,
        connect(db_dsn) as watch,
        checker.producer(dsn=writable) as p,
    ):
        await relay.ready()
        first = await p.produce("before")
        await tail.wait_for([first], within=30, what="an event before the switch")
        async with read_only_for_new_transactions(db_dsn):
            before = await _sessions(watch)
            waiting = [await p.produce(f"key-{n % 4}") for n in range(20)]
            await relay.line("read-only server, reconnecting", within=30)
            # Each retry is a new session. 24 retries of the relay's two workers take under
            # 9 s at its reconnect cadence (backoff capped at 1 s), and over 40 s in the
            # statement backoff (doubling from 0.05 s to 30 s), which would fail this wait.
            churn = await eventually(
                lambda: _grows(watch, None, before + 24),
                within=25,
                what="the relay's workers reconnect again and again to the read-only server",
            )
        healed = time.monotonic()
        # The one time bound that is the point of the test: with the workers retrying every
        # second at most, the waiting events arrive within a second or two of the server
        # taking writes again. 10 s is generous for a loaded machine, and still far below the
        # 15-30 s that a worker asleep in the statement backoff would take by then.
        arrived = await tail.wait_for(waiting, within=10, what="events after the server is back")
        FIGURES.recovery("read-only server", arrived - healed)
        FIGURES.notes["26: seconds for 24 sessions on the read-only server"] = round(churn, 2)
        await relay.line("PostgreSQL available again", within=10)
        report = await checker.drain_and_check(within=60)
        await relay.stop_ok()
    print(report.text())
    # One line for the whole episode, not one per retry.
    assert len(relay.matching("read-only")) == 1, relay.output()
    report.assert_ok()


async def _grows(conn: asyncpg.Connection, database: str | None, target: int) -> bool:
    return await _sessions(conn, database) >= target
