"""Scenario 29: outbox rows written in two-phase-commit transactions (PREPARE TRANSACTION).

A prepared transaction is neither committed nor rolled back: its rows are invisible to every
other session, it holds its locks and it stays in every snapshot's list of running
transactions, for as long as the transaction manager takes to decide. For the relay that
means: nothing of it may be published before ``COMMIT PREPARED``, nothing ever after
``ROLLBACK PREPARED``, and the claim's low-water mark (migration 0006), which moves past the
prepared row while later rows are published, must come back down for it once it commits.

PostgreSQL refuses to PREPARE a transaction that sent a NOTIFY, so a deployment with prepared
producers runs ``notify-mode off`` and poll-only relays (docs/concepts/gated-notify.md); so
does this test, with a short fallback poll.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from notify_outbox import OutboxNames, OutboxSettings, Relay
from notify_outbox.pg.sqlfiles import Queries
from tests.conftest import Services
from tests.faults.checker import OutboxChecker, PreparedEvent, Producer
from tests.faults.harness import KafkaTail, connect, eventually, fetchval, task_group

pytestmark = pytest.mark.anyio

POLL = 0.2  # the fallback poll is how a poll-only relay finds rows: keep it short


def _settings(db_dsn: str, services: Services) -> OutboxSettings:
    base: dict[str, Any] = {
        "dsn": db_dsn,
        "kafka_bootstrap_servers": services.bootstrap,
        "poll_only": True,
        "poll_interval": POLL,
        "workers": 2,
        "batch_size": 50,
        "keep_published": 3600.0,
    }
    return OutboxSettings.model_validate(base)


@asynccontextmanager
async def _prepared_cleanup(dsn: str) -> AsyncIterator[None]:
    """Roll back whatever prepared transaction the test leaves behind, however it ends: a
    prepared transaction outlives its session, holds the cluster's xmin horizon and keeps its
    database from being dropped."""
    try:
        yield
    finally:
        async with connect(dsn) as conn:
            for r in await conn.fetch(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
            ):
                await conn.execute(f"ROLLBACK PREPARED '{r['gid']}'")


async def _waits_on_key_lock(dsn: str, pid: int) -> bool:
    state = await fetchval(
        dsn,
        "SELECT wait_event_type || '/' || wait_event FROM pg_stat_activity WHERE pid = $1",
        pid,
    )
    return bool(state == "Lock/advisory")


async def test_29_two_phase_commit(db_dsn: str, services: Services, topic: str) -> None:
    """Three prepared transactions, each with one outbox row: A (key ``prep``) and C (key
    ``same``) are committed later, B (key ``gone``) rolled back. While they are prepared,
    writers commit events on other keys, and the relay (poll-only) claims and publishes them:
    rows committed after a PREPARE are not held up by it. Only once the relay's low-water mark
    has moved past A's row (so that A, once committed, lies below it), and two more polls ran,
    is it checked that none of A, B, C reached Kafka. Then COMMIT PREPARED A and C, ROLLBACK
    PREPARED B: A and C arrive (the mark came back down for them), B never does.

    The per-key order rule for a prepared row: the ordering trigger takes the key's
    transaction-scoped lock at the INSERT, and PREPARE keeps it until the second phase. So a
    later transaction writing the same key waits at its INSERT until COMMIT (or ROLLBACK)
    PREPARED, and the key's rows are in commit order, which is id order: D (key ``same``,
    begun while C is prepared) is seen waiting on that lock, and must arrive after C, which
    came after the ``same`` event committed before the PREPARE. The checker (I4) holds the
    relay to that order."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "29 two-phase").setup()
    async with connect(db_dsn) as admin:
        await admin.execute(Queries(OutboxNames())["set_notify_mode"], "off")
    tag = uuid.uuid4().hex[:8]
    load = checker.writers(writers=2, keys=10, pause=0.01)
    async with (
        _prepared_cleanup(db_dsn),
        Relay(_settings(db_dsn, services)) as relay,
        KafkaTail(services.bootstrap, [topic]) as tail,
        checker.producer() as p,
        checker.producer() as blocked,
        connect(db_dsn) as second_phase,
        task_group() as tg,
    ):
        before = await p.produce("same")
        await tail.wait_for([before], within=30, what="an event before the PREPAREs")
        a = await p.prepare("prep", f"a-{tag}")
        b = await p.prepare("gone", f"b-{tag}")
        c = await p.prepare("same", f"c-{tag}")
        prepared: list[PreparedEvent] = [a, b, c]
        d_id: list[str] = []

        async def same_key_after_c(q: Producer) -> None:
            d_id.append(await q.produce("same"))

        tg.start_soon(same_key_after_c, blocked)
        assert blocked.conn is not None
        pid = blocked.conn.get_server_pid()
        await eventually(
            lambda: _waits_on_key_lock(db_dsn, pid),
            within=30,
            what="D waits on the key lock of the prepared C",
        )
        tg.start_soon(load.run)

        # Later commits flow while A, B, C are prepared, and the relay's mark passes them by.
        # (Whether the mark lists A's transaction is the relay's business: what matters is
        # that A arrives once committed, below a mark that passed it.)
        async def mark_past_a() -> bool:
            return relay.low_water_mark.low > a.row_id

        await eventually(
            lambda: _published_at_least(tail, checker, 200),
            within=60,
            what="200 events committed after the PREPAREs reached Kafka",
        )
        await eventually(
            mark_past_a, within=30, what="the relay's mark moved past the prepared row A"
        )
        polls = relay.events.counts["poll"]
        with anyio.fail_after(30):
            await relay.events.wait_for("poll", polls + 2)
        early = {e.event_id for e in prepared} & tail.first_seen.keys()
        assert not early, f"published before the second phase: {early}"
        assert not d_id, "D committed while C was still prepared"

        await a.commit(second_phase)
        await b.rollback(second_phase)
        await c.commit(second_phase)
        await eventually(
            lambda: _true(bool(d_id)), within=30, what="D commits once C's key lock is gone"
        )
        await tail.wait_for(
            [a.event_id, c.event_id, d_id[0]],
            within=30,
            what="rows of committed prepared transactions, and D after C",
        )
        after = await p.produce("gone")  # B's key goes on
        await tail.wait_for([after], within=30, what="an event after ROLLBACK PREPARED")
        polls = relay.events.counts["poll"]
        with anyio.fail_after(30):
            await relay.events.wait_for("poll", polls + 2)
        await load.halt()
        report = await checker.drain_and_check(within=60)
    print(report.text())
    print(
        f"prepared row A id {a.row_id} (xid {a.xid}); rows committed meanwhile: "
        f"{len(tail.first_seen)} in Kafka"
    )
    assert b.event_id not in tail.first_seen, "a row of ROLLBACK PREPARED was published"
    report.assert_ok()
    assert report.duplicates == 0


async def _published_at_least(tail: KafkaTail, checker: OutboxChecker, n: int) -> bool:
    committed = checker.ledger.ids("committed")
    return len(committed & tail.first_seen.keys()) >= n


async def _true(value: bool) -> bool:
    return value
