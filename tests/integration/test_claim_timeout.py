"""The claim's idle timeout in auto mode (stalls.py), against real PostgreSQL and Kafka: a relay
with `claim_idle_timeout=auto` learns a timeout well under the 2 s ceiling on a healthy loop, the
claims it makes carry it, and when its event loop stops right after a claim (blocked: no
coroutine runs, as under SIGSTOP or a long GC pause) PostgreSQL ends that claim once it has been
idle for that timeout (watched in pg_stat_activity while the loop is blocked); resumed, the
relay finds the claim gone before it sends anything, says why, claims again and delivers the
row once."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import asyncpg
import psycopg
import pytest
from psycopg.rows import TupleRow

from notify_outbox import Relay
from notify_outbox.relay.stalls import AUTO_CEILING, WARMUP
from tests.conftest import Services
from tests.faults.harness import eventually
from tests.integration.test_relay import make_settings
from tests.support import consume

pytestmark = pytest.mark.anyio

# How long the blocked loop waits for PostgreSQL to end the claim: far beyond any timeout the
# relay can learn (the ceiling is AUTO_CEILING), so that only a claim that never ends fails.
END_WITHIN = 30.0


@dataclass
class _Ending:
    """What the blocked loop saw of its claim's backend in pg_stat_activity."""

    timeout: float  # the claim's timeout, in force when the loop was blocked
    pids: list[int] = field(default_factory=list)  # the worker's backends idle in transaction
    idle_for: float | None = None  # how long they had been idle when first seen gone


def _watch_claim_end(watcher: psycopg.Connection[TupleRow], ending: _Ending) -> None:
    """Block (the relay's loop with it) until the relay's backends that are idle in transaction
    (its claim, held across this hook) are gone, or ``END_WITHIN`` passed; say how long they
    had been idle by the server's clock when they were first seen gone."""
    rows = watcher.execute(
        "SELECT pid, state_change FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name LIKE 'notify-outbox-worker%'"
        " AND state = 'idle in transaction'"
    ).fetchall()
    ending.pids = [pid for pid, _ in rows]
    if not rows:
        return
    since = min(changed for _, changed in rows)
    deadline = time.monotonic() + END_WITHIN
    while time.monotonic() < deadline:
        gone, idle_for = watcher.execute(
            "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s)),"
            " extract(epoch FROM clock_timestamp() - %s)::float8",
            (ending.pids, since),
        ).fetchone() or (False, 0.0)
        if gone:
            ending.idle_for = float(idle_for)
            return
        time.sleep(0.01)


async def test_a_blocked_relay_loses_its_claim_after_the_timeout_it_learnt(
    db_dsn: str, services: Services, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    blocked: list[_Ending] = []

    def hook(point: str) -> None:
        if point == "after_claim" and armed and not blocked:
            # The timeout this claim was given: current() may have moved since (a BEGIN's
            # round trip, measured after the claim asked, can raise it).
            assert relay.claim_timeout.given is not None
            blocked.append(_Ending(relay.claim_timeout.given))
            _watch_claim_end(watcher, blocked[0])

    armed = False
    # A connection of the test's own, synchronous: the hook runs inside the blocked loop.
    watcher = psycopg.connect(db_dsn, autocommit=True)
    caplog.set_level(logging.WARNING, logger="notify_outbox")
    s = make_settings(db_dsn, services, workers=1, claim_idle_timeout="auto")
    relay = Relay(s, fault_hook=hook)
    try:
        async with relay:
            assert relay.claim_timeout.auto
            conn = await asyncpg.connect(db_dsn)
            try:
                # A first row: the watch of the loop rests until claims come.
                await conn.execute("INSERT INTO outbox (topic, key) VALUES ($1, 'warm-up')", topic)
                await consume(services.bootstrap, topic, expect=1, within=30)
            finally:
                await conn.close()

            async def warm() -> bool:
                return len(relay.claim_timeout.loop) >= WARMUP

            await eventually(warm, within=30, what="the relay's loop watch warmed up")
            learnt = relay.claim_timeout.current()
            assert learnt < AUTO_CEILING / 1.5, (
                f"a relay on a healthy loop learnt {learnt:.2f}s (the ceiling is {AUTO_CEILING}s)"
            )
            armed = True
            conn = await asyncpg.connect(db_dsn)
            try:
                await conn.execute("INSERT INTO outbox (topic, key) VALUES ($1, 'k')", topic)

                async def settled() -> bool:
                    return not await conn.fetchval("SELECT count(*) FROM outbox")

                # Published by the claim after the lost one.
                await eventually(settled, within=30, what="the row was published and deleted")
            finally:
                await conn.close()
    finally:
        watcher.close()
    # One copy: resumed long after its claim, the relay asked whether the claim was still
    # there before sending its rows, and sent nothing on the lost claim.
    _, total = await consume(services.bootstrap, topic, expect=2, within=30)
    assert total == 2, f"{total - 1} copies of the row in Kafka (and the warm-up row)"
    assert blocked, "the relay never claimed the row"
    ending = blocked[0]
    assert ending.pids, "no backend of the relay was idle in transaction while its loop was blocked"
    # PostgreSQL ended the claim, and not before it had been idle for its timeout.
    assert ending.idle_for is not None, (
        f"the relay's claim (timeout {ending.timeout:.2f}s) was still open {END_WITHIN}s after "
        "its loop was blocked"
    )
    assert ending.idle_for >= ending.timeout, (ending.idle_for, ending.timeout)
    # A stall, not a database outage: no backoff, no "PostgreSQL unavailable".
    assert relay.events.counts["claim_lost"] == 1
    assert relay.events.counts["db_error"] == 0
    ended = [r.getMessage() for r in caplog.records if "PostgreSQL ended it" in r.getMessage()]
    assert ended, "the relay did not say that PostgreSQL ended its claim"
