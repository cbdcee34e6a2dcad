"""The claim's idle timeout in auto mode (stalls.py), against real PostgreSQL and Kafka: a relay
with `claim_idle_timeout=auto` learns a timeout well under the 2 s ceiling on a healthy loop, the
claims it makes carry it, and when its event loop stops right after a claim (blocked: no
coroutine runs, as under SIGSTOP or a long GC pause) PostgreSQL ends that claim; resumed, the
relay finds the claim gone before it sends anything, says why, claims again and delivers the
row once."""

from __future__ import annotations

import logging
import time

import asyncpg
import pytest

from notify_outbox import Relay
from notify_outbox.relay.stalls import AUTO_CEILING, WARMUP
from tests.conftest import Services
from tests.faults.harness import eventually
from tests.integration.test_relay import make_settings
from tests.support import consume

pytestmark = pytest.mark.anyio


async def test_a_blocked_relay_loses_its_claim_after_the_timeout_it_learnt(
    db_dsn: str, services: Services, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    blocked: list[float] = []  # the timeout in force when the loop was blocked

    def hook(point: str) -> None:
        if point == "after_claim" and armed and not blocked:
            timeout = relay.claim_timeout.current()
            blocked.append(timeout)
            # Three timeouts: PostgreSQL has ended the claim by then, if it carried it.
            time.sleep(3 * timeout)

    armed = False
    caplog.set_level(logging.WARNING, logger="notify_outbox")
    s = make_settings(db_dsn, services, workers=1, claim_idle_timeout="auto")
    relay = Relay(s, fault_hook=hook)
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
    # One copy: resumed long after its claim, the relay asked whether the claim was still
    # there before sending its rows, and sent nothing on the lost claim.
    _, total = await consume(services.bootstrap, topic, expect=2, within=30)
    assert total == 2, f"{total - 1} copies of the row in Kafka (and the warm-up row)"
    assert blocked, "the relay never claimed the row"
    # A stall, not a database outage: no backoff, no "PostgreSQL unavailable".
    assert relay.events.counts["claim_lost"] == 1
    assert relay.events.counts["db_error"] == 0
    ended = [r.getMessage() for r in caplog.records if "PostgreSQL ended it" in r.getMessage()]
    assert ended, (
        f"blocked for {3 * blocked[0]:.2f}s after a claim whose timeout was {blocked[0]:.2f}s, "
        "the relay's claim was not ended by PostgreSQL"
    )
