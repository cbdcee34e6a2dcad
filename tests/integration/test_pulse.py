"""The pulse's reaper (pulse.py) against a real PostgreSQL: it ends exactly the worker sessions
of relays whose process stopped (idle in a transaction, their pulse session idle as long), and
no other session; it rests while its relay does not claim. A relay whose pulse ran late
(starved of CPU) carries a longer tolerance in its statements, and is ended only after it; a
reaper that ran late itself waits longer too.

Sessions stand in for relays here (the names are what the reaper reads); a real relay frozen
with SIGSTOP is tests/faults/test_held_claims.py, scenario 33, and one starved of CPU,
scenario 34."""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import asyncpg
import pytest

from notify_outbox.relay import pulse as pulse_module
from notify_outbox.relay.pulse import Pulse, pulse_app, tagged, tolerance_for, worker_app
from tests.faults.harness import eventually

pytestmark = pytest.mark.anyio

TIMEOUT = 0.4


@asynccontextmanager
async def session(dsn: str, app: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(dsn, server_settings={"application_name": app})
    try:
        yield conn
    finally:
        conn.terminate()


async def _alive(watch: asyncpg.Connection, conn: asyncpg.Connection) -> bool:
    pid = conn.get_server_pid()
    return bool(await watch.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid))


async def test_the_pulse_ends_only_the_claims_of_a_relay_whose_process_stopped(
    db_dsn: str,
) -> None:
    reaped: list[int] = []
    async with (
        session(db_dsn, "watch") as watch,
        # A stopped relay: a worker idle in its transaction, its pulse session idle as long.
        session(db_dsn, worker_app("stopped1")) as stopped_worker,
        session(db_dsn, pulse_app("stopped1")) as stopped_pulse,
        # A live relay: its worker is idle in a transaction just as long, but it pulses.
        session(db_dsn, worker_app("alive001")) as live_worker,
        session(db_dsn, pulse_app("alive001")) as live_pulse,
        # A relay without a pulse (an older version, or pulse off): never ended.
        session(db_dsn, worker_app("nopulse1")) as unpulsed_worker,
        # Not a relay at all.
        session(db_dsn, "psql") as other,
        # A stopped relay's worker that is not in a transaction: it holds nothing.
        session(db_dsn, worker_app("stopped1")) as stopped_idle,
    ):
        await stopped_pulse.execute("SELECT 1")
        # The stopped relay's pulse went silent a timeout before its claim did: the claim
        # must still sit idle a timeout of its own before it is ended.
        await anyio.sleep(TIMEOUT)
        for conn in (stopped_worker, live_worker, unpulsed_worker, other):
            await conn.execute("BEGIN; SELECT 1")
        went_idle = time.monotonic()

        async def beat() -> None:
            while True:
                await live_pulse.execute("SELECT 1")
                await anyio.sleep(0.02)

        pulse = Pulse(
            db_dsn,
            "reaper01",
            TIMEOUT,
            command_timeout=5,
            on_reaped=reaped.append,
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(beat)
            pulse.start()
            try:
                pulse.claim_started()  # the reaping relay claims: its pulse beats
                await eventually(
                    lambda: _ended(watch, stopped_worker),
                    within=10,
                    what="the stopped relay's claim session was ended",
                )
                ended_after = time.monotonic() - went_idle
                # It ended nothing else, then or in its next reaper statements (every other
                # session has sat idle far longer than the timeout by now).
                reaps = pulse.reaps
                await eventually(
                    lambda: _true(pulse.reaps >= reaps + 5), within=10, what="it reaps on"
                )
                for conn in (stopped_pulse, live_worker, unpulsed_worker, other, stopped_idle):
                    assert await _alive(watch, conn), conn.get_settings().application_name
                pulse.claim_ended()
            finally:
                await pulse.stop()
                tg.cancel_scope.cancel()
    # Not before its session (and its pulse) had been silent for the timeout, less the round
    # trip between the server's clock and ours.
    assert ended_after >= TIMEOUT - 0.05, f"ended after {ended_after:.2f}s"
    assert pulse.reaped == 1
    await eventually(lambda: _true(reaped == [1]), within=5, what="the relay was told")


async def test_a_relay_whose_pulse_ran_late_is_ended_only_after_the_tolerance_it_carries(
    db_dsn: str,
) -> None:
    """Two relays stop at once, each inside a claim: one whose pulse never ran late (its last
    statement carries the plain timeout) and one whose pulse had run 0.5 s late (a throttled
    container: it carries three times that). The reaper ends the first after the timeout,
    and the second only once it was silent for its own tolerance."""
    base = 0.15
    tolerant = tolerance_for(base, 0.5)
    assert tolerant == 1.5
    reaped: list[int] = []
    async with (
        session(db_dsn, "watch") as watch,
        session(db_dsn, worker_app("frozen01")) as frozen_worker,
        session(db_dsn, pulse_app("frozen01")) as frozen_pulse,
        session(db_dsn, worker_app("starved1")) as starved_worker,
        session(db_dsn, pulse_app("starved1")) as starved_pulse,
    ):
        # Their pulses' last statements, as the pulse sends them; then both claims go idle.
        await frozen_pulse.execute(tagged("SELECT 1", base))
        await starved_pulse.execute(tagged("SELECT 1", tolerant))
        for conn in (frozen_worker, starved_worker):
            await conn.execute("BEGIN; SELECT 1")
        went_idle = time.monotonic()
        pulse = Pulse(db_dsn, "reaper03", base, command_timeout=5, on_reaped=reaped.append)
        pulse.start()
        try:
            pulse.claim_started()  # the reaping relay claims: its pulse beats, and reaps
            await eventually(
                lambda: _ended(watch, frozen_worker),
                within=10,
                what="the claim of the relay that never ran late was ended",
            )
            frozen_after = time.monotonic() - went_idle
            assert await _alive(watch, starved_worker), (
                f"the starved relay's claim was ended with the frozen one's, after "
                f"{frozen_after:.2f}s: its tolerance ({tolerant}s) was not read"
            )
            starved_after = await _ended_after(
                watch, starved_worker, went_idle, "the starved relay's claim"
            )
            pulse.claim_ended()
        finally:
            await pulse.stop()
    # Each not before its own tolerance (less the round trip between the server's clock and
    # ours), and the first long before the second's.
    assert frozen_after >= base - 0.05, f"ended after {frozen_after:.2f}s"
    assert frozen_after < tolerant - 0.05, f"ended after {frozen_after:.2f}s"
    assert starved_after >= tolerant - 0.05, f"ended after {starved_after:.2f}s"
    assert pulse.reaped == 2


async def test_a_relay_under_a_cpu_quota_tells_its_floor_before_any_claim_and_is_ended_after_it(
    db_dsn: str,
) -> None:
    """A relay in a container with a CPU quota of 0.5 s periods may be stopped for most of a
    period from its first busy second, before its pulse ran late once: its pulse session
    carries two periods (1 s) from the start, so a peer ends its claim only after that, not
    after frozen_relay_timeout (its first claims were ended, and sent twice, before)."""
    base = 0.15
    quota_pulse = Pulse(
        db_dsn,
        "quota001",
        base,
        command_timeout=5,
        on_reaped=lambda n: None,
        quota_period=lambda: 0.5,
    )
    assert quota_pulse.tolerance() == 1.0
    reaped: list[int] = []
    async with (
        session(db_dsn, "watch") as watch,
        session(db_dsn, worker_app("quota001")) as throttled_worker,
    ):
        quota_pulse.start()
        try:
            # No claim yet: the pulse opened its session and told its tolerance on it.
            await eventually(
                lambda: _true_async(
                    watch.fetchval(
                        "SELECT query FROM pg_stat_activity WHERE application_name = $1",
                        pulse_app("quota001"),
                    ),
                    lambda q: isinstance(q, str) and q.startswith(tagged("", 1.0)),
                ),
                within=10,
                what="the throttled relay's pulse session carries its 1 s tolerance",
            )
            # Then the relay is stopped inside a claim (its pulse thread has no claim to beat
            # for: its session stays idle, as a stopped one's).
            await throttled_worker.execute("BEGIN; SELECT 1")
            went_idle = time.monotonic()
            reaper = Pulse(db_dsn, "reaper05", base, command_timeout=5, on_reaped=reaped.append)
            reaper.start()
            try:
                reaper.claim_started()
                ended_after = await _ended_after(
                    watch, throttled_worker, went_idle, "the throttled relay's claim"
                )
                reaper.claim_ended()
            finally:
                await reaper.stop()
        finally:
            await quota_pulse.stop()
    assert ended_after >= 1.0 - 0.05, f"ended after {ended_after:.2f}s, not after 1 s"
    assert reaper.reaped == 1


async def test_a_pulse_starved_of_the_interpreter_carries_its_lateness_and_reaps_later(
    db_dsn: str,
) -> None:
    """A relay's pulse thread kept from running for 0.5 s (its process holds the interpreter:
    a starved relay, as seen from its thread) notes how late it woke. Its statements carry
    the tolerance that follows (three times that: other relays wait so long before they take
    it for stopped), and as a reaper it waits as long before it ends a silent peer (it was
    starved: so may its peers have been)."""
    base = 0.15
    async with session(db_dsn, "watch") as watch:
        pulse = Pulse(db_dsn, "starved2", base, command_timeout=5, on_reaped=lambda _n: None)
        pulse.start()
        try:
            pulse.claim_started()  # a long claim: the pulse beats every PULSE_EVERY
            await eventually(lambda: _true(pulse.pulses >= 3), within=10, what="it beats")
            # A busy host (CI runs two suites side by side) may have delayed the thread
            # already: the starvation below goes 0.5 s beyond that, so that it shows.
            before = pulse.lateness.worst()
            assert before < 1.0, f"the host starved the thread ({before:.3f}s) before the test"
            # Starve its thread: this thread keeps the interpreter (the thread waits for it up
            # to the switch interval before it asks for it).
            interval = sys.getswitchinterval()
            sys.setswitchinterval(5.0)
            try:
                until = time.monotonic() + before + 0.5
                while time.monotonic() < until:
                    pass
            finally:
                sys.setswitchinterval(interval)
            await eventually(
                lambda: _true(pulse.lateness.worst() >= before + 0.3),
                within=10,
                what="the pulse noted how late it woke",
            )
            tolerance = pulse.tolerance()
            assert tolerance >= 0.9, f"{tolerance}s for a delay of {pulse.lateness.worst()}s"
            tag = tagged("", tolerance)

            async def carried() -> bool:
                query = await watch.fetchval(
                    "SELECT query FROM pg_stat_activity WHERE application_name = $1",
                    pulse_app("starved2"),
                )
                return bool(query and query.startswith(tag))

            await eventually(carried, within=10, what=f"its statements carry {tag!r}")
            # A peer stops inside a claim (its pulse silent as long): the starved reaper ends
            # it only after its own tolerance, not after the timeout.
            async with (
                session(db_dsn, worker_app("peer0002")) as peer_worker,
                session(db_dsn, pulse_app("peer0002")) as peer_pulse,
            ):
                await peer_pulse.execute("SELECT 1")
                await peer_worker.execute("BEGIN; SELECT 1")
                went_idle = time.monotonic()
                await eventually(
                    lambda: _ended(watch, peer_worker),
                    within=10,
                    what="the starved reaper ended the stopped peer's claim",
                )
                ended_after = time.monotonic() - went_idle
            pulse.claim_ended()
        finally:
            await pulse.stop()
    # Its tolerance lasts for LATENESS_WINDOW samples at least (5 s of beats, longer than this
    # test): the peer was ended only once silent that long.
    assert ended_after >= tolerance - 0.05, f"ended after {ended_after:.2f}s, not {tolerance}s"
    assert pulse.reaped == 1


async def test_the_pulse_beats_only_for_long_claims_and_after_busy_buckets(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A loaded host delays the thread, which would grow its tolerance and tell it in a
    # statement ("tell", tested above): kept out of this test's statement counts.
    monkeypatch.setattr(pulse_module, "FACTOR", 0.0)
    monkeypatch.setattr(pulse_module, "WATCH_FOR", 0.3)
    monkeypatch.setattr(pulse_module, "REAP_AT_LEAST", 0.3)
    monkeypatch.setattr(pulse_module, "PEERS_EVERY", 0.2)
    pulse = Pulse(db_dsn, "rest0001", 0.05, command_timeout=5, on_reaped=lambda _n: None)
    pulse.start()
    try:
        # Its session is there from the start, before any claim: a relay whose claim froze
        # before its first beat is still seen as stopped.
        async with session(db_dsn, "watch") as watch:

            async def opened() -> bool:
                n = await watch.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                    pulse_app("rest0001"),
                )
                return bool(n)

            await eventually(opened, within=10, what="the pulse session is open")
        # A claim shorter than BEAT_AFTER (made long here, so that a loaded host cannot
        # stretch the claim past it) costs no beat.
        monkeypatch.setattr(pulse_module, "BEAT_AFTER", 5.0)
        pulse.claim_started()
        pulse.claim_ended()
        await eventually(lambda: _true(pulse._asleep), within=10, what="it sleeps")
        assert pulse.pulses == 0, "it beat for a short claim"
        # A long claim: it beats while the claim is open.
        monkeypatch.setattr(pulse_module, "BEAT_AFTER", 0.05)
        pulse.claim_started()
        await eventually(lambda: _true(pulse.pulses >= 3), within=10, what="it beats")
        pulse.claim_ended()
        await eventually(lambda: _true(pulse._asleep), within=10, what="it sleeps again")
        asleep = pulse.pulses
        # Woken by a short claim, it looks at the claims (no statement) and sleeps again.
        monkeypatch.setattr(pulse_module, "BEAT_AFTER", 5.0)
        pulse.claim_started()
        pulse.claim_ended()
        assert not pulse._asleep
        await eventually(lambda: _true(pulse._asleep), within=10, what="back to sleep")
        assert pulse.pulses == asleep, "it beat for a short claim or while asleep"
        monkeypatch.setattr(pulse_module, "BEAT_AFTER", 0.05)
        # A claim met buckets held by others, and no other relay has a pulse: one look for
        # peers, and no reaper (nobody to end).
        reaps = pulse.reaps
        pulse.saw_busy()
        await eventually(lambda: _true(pulse.pulses > asleep), within=10, what="it looks")
        await eventually(lambda: _true(pulse._asleep), within=10, what="asleep after busy")
        assert pulse.reaps == reaps, "it ran the reaper with no other relay around"
        # With another relay's pulse connected, busy buckets make it reap for a while.
        async with session(db_dsn, pulse_app("peer0001")):
            pulse.saw_busy()
            await eventually(
                lambda: _true(pulse.reaps >= reaps + 3), within=10, what="it reaps beside a peer"
            )
        await eventually(lambda: _true(pulse._asleep), within=10, what="asleep again")
    finally:
        await pulse.stop()


async def _ended(watch: asyncpg.Connection, conn: asyncpg.Connection) -> bool:
    return not await _alive(watch, conn)


async def _ended_after(
    watch: asyncpg.Connection, conn: asyncpg.Connection, went_idle: float, whose: str
) -> float:
    """Seconds from ``went_idle`` until ``conn``'s session was ended (a reaper's doing)."""
    await eventually(
        lambda: _ended(watch, conn),
        within=10,
        what=f"{whose} was ended once silent for its tolerance",
    )
    return time.monotonic() - went_idle


async def _true(value: bool) -> bool:
    return value


async def _true_async(value: Awaitable[object], test: Callable[[object], bool]) -> bool:
    return test(await value)
