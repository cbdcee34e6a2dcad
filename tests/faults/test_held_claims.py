"""A relay that stops answering while it holds a claim.

Scenarios: 31 a relay frozen (SIGSTOP) right after a claim; 32 a relay whose worker
connections go silent (the proxy swallows every byte, nothing is closed) right after a claim;
33 as 31, with the relays' pulses on (the default): the other relay ends the frozen claim;
34 a relay alive but starved of CPU (stopped and resumed again and again, as a container at
its CPU quota), pulses on: the other relay ends none of its claims once its pulse ran late.

In 31 and 32, PostgreSQL ends the claim after ``claim_idle_timeout`` (``SET LOCAL
idle_in_transaction_session_timeout`` in the claim's ``BEGIN``), another relay delivers its
rows without waiting for the fallback poll (300 s here), and relay A, once it runs again,
finds its claim gone, claims anew and keeps delivering. In 31, A finds the claim gone before
it sends anything (nothing is sent twice); in 32 only the rows of A's claim may be.

Relay A stops itself at the claim (``NOTIFY_OUTBOX_TEST_STOP_AT=after_claim``, one worker):
the moment is exact, not timing luck. A reaches PostgreSQL through a ``SilentProxy`` (its
listener directly, ``NOTIFY_OUTBOX_LISTEN_DSN``), so the server sessions of A's workers are
known by their ``client_port``, and the rows of its claim by their ``xmax``.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import anyio
import anyio.abc
import asyncpg
import pytest

from notify_outbox import OutboxNames
from notify_outbox.pg.sqlfiles import Queries
from notify_outbox.relay.pulse import PULSE_APP, WORKER_APP
from tests.conftest import Services
from tests.faults.checker import FIGURES, CheckReport, OutboxChecker
from tests.faults.harness import (
    FaultRelay,
    KafkaTail,
    SilentProxy,
    connect,
    dsn_with_port,
    eventually,
    idle_latency,
    log_time,
    relays,
    task_group,
)
from tests.support import create_topics

pytestmark = pytest.mark.anyio

CLAIM_IDLE = 2.0  # claim_idle_timeout of both relays (s)
# Room for a loaded machine above what the relays promise. Without the server's timeout the
# frozen claim holds its rows for as long as A does not run: far beyond this.
MARGIN = 10.0

ENV = {
    "NOTIFY_OUTBOX_CLAIM_IDLE_TIMEOUT": str(CLAIM_IDLE),
    # 31 and 32 prove the server's timeout, the backstop for relays without a pulse (an
    # older version, a pooler); 33 the pulse (pulse.py), which ends a frozen claim sooner.
    "NOTIFY_OUTBOX_FROZEN_RELAY_TIMEOUT": "0",
    # Nothing here may be rescued by the fallback poll.
    "NOTIFY_OUTBOX_POLL_INTERVAL": "300",
    "NOTIFY_OUTBOX_BATCH_SIZE": "20",
}

# The claim of each proxied (relay A's) worker session inside a transaction: the rows it
# locked (FOR UPDATE stamps them with its xid) and when it went idle (server clock, the same
# host as the test's).
_CLAIMS = """
SELECT a.pid, a.state, extract(epoch FROM a.state_change)::float8 AS since,
       array(SELECT o.event_id::text FROM outbox o
             WHERE o.xmax = a.backend_xid AND o.published_at IS NULL) AS held
FROM pg_stat_activity a
WHERE a.datname = current_database() AND a.client_port = ANY($1::int[])
  AND a.xact_start IS NOT NULL
"""


@dataclass(frozen=True)
class Claim:
    pid: int
    since: float  # epoch seconds when the session went idle in its transaction
    held: frozenset[str]  # event ids of the rows it locked


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): state T in /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


async def _frozen(relay: FaultRelay) -> bool:
    return _stopped(relay.proc.pid)


async def _frozen_claim(watch: asyncpg.Connection, proxy: SilentProxy) -> Claim:
    """Relay A's one claim, A being stopped in it (seen stopped: A stops itself once its
    claim returned rows, so its session is idle in that transaction from then on, until
    PostgreSQL or relay B ends it): one look, no window to guess."""
    rows = await watch.fetch(_CLAIMS, proxy.upstream_ports())
    assert rows, (
        "relay A is stopped in its claim, but no session of A's is in a transaction: it was "
        "ended before the test looked (the host took longer than the claim's timeout)"
    )
    assert all(r["state"] == "idle in transaction" for r in rows), [dict(r) for r in rows]
    assert len(rows) == 1, f"one worker, one claim: {[dict(r) for r in rows]}"
    (row,) = rows
    assert row["held"], "relay A stopped after a claim that locked no row"
    return Claim(row["pid"], row["since"], frozenset(row["held"]))


async def _ended(watch: asyncpg.Connection, pid: int) -> bool:
    return not await watch.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid)


def _wall(monotonic: float) -> float:
    """A ``time.monotonic()`` reading (KafkaTail's arrivals) as epoch seconds."""
    return time.time() - (time.monotonic() - monotonic)


def _relay_a(proxy: SilentProxy, db_dsn: str, services: Services, **env: str) -> FaultRelay:
    return FaultRelay(
        dsn_with_port(db_dsn, "127.0.0.1", proxy.port),
        services.bootstrap,
        env={
            **ENV,
            "NOTIFY_OUTBOX_WORKERS": "1",  # at the stop, the claim is the one thing in flight
            "NOTIFY_OUTBOX_TEST_STOP_AT": "after_claim",
            "NOTIFY_OUTBOX_LISTEN_DSN": db_dsn,
            **env,
        },
        name="relay-a",
    )


def _proxy(db_dsn: str) -> SilentProxy:
    parts = urlsplit(db_dsn)
    return SilentProxy(parts.hostname or "127.0.0.1", parts.port or 5432)


async def _settled(watch: asyncpg.Connection, claim: Claim) -> bool:
    """Whether every row of the claim was published and deleted (keep_published 0)."""
    left = await watch.fetchval(
        "SELECT count(*) FROM outbox WHERE event_id::text = ANY($1::text[])", list(claim.held)
    )
    return not left


async def _released(
    watch: asyncpg.Connection,
    claim: Claim,
    label: str,
    *,
    after: float = CLAIM_IDLE,
    by: str = "PostgreSQL",
    setting: str = "claim_idle_timeout",
) -> float:
    """``by`` (PostgreSQL, after ``claim_idle_timeout``; or relay B's pulse, after
    ``frozen_relay_timeout``) ends A's claim about ``after`` seconds after it went idle, and
    relay B publishes and deletes its rows soon after (B's claims saw A's buckets busy and
    look again once it ended): both timed from the moment the claim went idle. Returns when
    the claim ended."""
    await eventually(
        lambda: _ended(watch, claim.pid),
        within=after + MARGIN,
        what=f"{by} ended relay A's claim ({setting})",
    )
    ended = time.time() - claim.since
    await eventually(
        lambda: _settled(watch, claim),
        within=after + MARGIN,
        what="another relay published (and deleted) the rows of relay A's claim",
    )
    settled = time.time() - claim.since
    FIGURES.recovery(f"{label}: claim ended by {by}", ended)
    FIGURES.recovery(f"{label}: its rows settled by another relay", settled)
    print(
        f"{label}: claim of {len(claim.held)} rows ended {ended:.2f}s after it went idle "
        f"({setting} {after}s); its rows settled by relay B after {settled:.2f}s"
    )
    assert ended <= after + MARGIN, f"the claim held its rows {ended:.1f}s"
    assert settled <= after + MARGIN, f"its rows were settled after {settled:.1f}s"
    return ended


class Scene(NamedTuple):
    """Relays A (stopped in its claim) and B, with what the scenarios look through."""

    a: FaultRelay
    b: FaultRelay
    tail: KafkaTail
    tg: anyio.abc.TaskGroup
    p: Any  # the checker's producer
    watch: asyncpg.Connection
    claim: Claim


@asynccontextmanager
async def _a_stopped_in_a_claim(
    checker: OutboxChecker,
    proxy: SilentProxy,
    services: Services,
    db_dsn: str,
    topic: str,
    load: Any,
    env: dict[str, str],
) -> AsyncIterator[Scene]:
    """Relays A (through ``proxy``, stopping itself at its first claim) and B start; a burst
    of 200 rows over 10 keys, then ``load`` runs; yields once A is stopped inside its claim
    (A's claim takes a batch of keys, heads and followers, whose later rows must wait)."""
    a = _relay_a(proxy, db_dsn, services, **env)
    b = FaultRelay(db_dsn, services.bootstrap, env={**ENV, **env}, name="relay-b")
    async with (
        relays(a, b),
        KafkaTail(services.bootstrap, [topic]) as tail,
        task_group() as tg,
        checker.producer() as p,
        connect(db_dsn) as watch,
    ):
        await a.ready()
        await b.ready()
        await p.bulk([f"key-{i % 10}" for i in range(200)])
        tg.start_soon(load.run)
        await eventually(lambda: _frozen(a), within=60, what="relay A stopped in a claim")
        claim = await _frozen_claim(watch, proxy)
        yield Scene(a, b, tail, tg, p, watch, claim)


async def _a_alone(
    a: FaultRelay,
    b: FaultRelay,
    p: Any,
    tail: KafkaTail,
    checker: OutboxChecker,
    db_dsn: str,
    scenario: str,
    state: str,
) -> CheckReport:
    """Relay B stops; relay A alone delivers an event on the idle relay at once; then every
    committed event is checked and A stops."""
    await b.stop_ok()
    latency = await idle_latency(
        db_dsn, lambda: p.produce("idle"), tail, what=f"relay A alone, {state}"
    )
    print(f"{scenario}: relay A alone, {state}: an event on the idle relay in {latency:.2f}s")
    report = await checker.drain_and_check(within=60)
    await a.stop_ok()
    return report


async def test_31_a_relay_frozen_in_its_claim_loses_it_after_claim_idle_timeout(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Relay A freezes right after a claim while writers run. The writers stop (so only the
    relays' own wake-ups are left); PostgreSQL ends A's claim after claim_idle_timeout, and
    relay B delivers its rows, A still frozen. Resumed among new writers, A asks whether its
    claim is still there before it sends the batch (it resumed long after the claim), finds it
    ended, sends nothing of it, says so once, and claims again; alone after B stops, it still
    delivers at once. No event is sent twice."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "31 frozen claim").setup()
    before = checker.writers(writers=2, keys=10, pause=0.01)
    after = checker.writers(writers=2, keys=10, pause=0.01, seed=1, max_events=100)
    with _proxy(db_dsn) as proxy:
        scene = _a_stopped_in_a_claim(checker, proxy, services, db_dsn, topic, before, {})
        async with scene as (a, b, tail, tg, p, watch, claim):
            await before.halt()
            await _released(watch, claim, "31 frozen relay")
            # A is frozen: the first copies in Kafka are B's.
            arrived = await tail.wait_for(claim.held, within=MARGIN, what="A's claimed rows")
            delivered = _wall(arrived) - claim.since
            print(f"31: relay B's copies of them in Kafka {delivered:.2f}s after it went idle")
            assert delivered <= CLAIM_IDLE + MARGIN
            assert _stopped(a.proc.pid), "relay A woke up: the test proves nothing"
            tg.start_soon(after.run)
            a.signal(signal.SIGCONT)
            # Its claim's session is gone: A asks before sending, says why the claim ended
            # (not as a database outage), then claims on a new connection.
            await a.line("and PostgreSQL ended it", within=30)
            with anyio.fail_after(60):
                await after.finished.wait()
            report = await _a_alone(a, b, p, tail, checker, db_dsn, "31", "resumed")
    print(report.text())
    report.assert_ok()


async def test_32_a_relay_cut_off_from_postgresql_mid_claim(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Relay A's worker connections go silent while it holds a claim (writers running): the
    proxy swallows every byte both ways and closes nothing, like a dead NAT entry, so neither
    side hears of it from TCP. PostgreSQL still ends A's claim after claim_idle_timeout (what
    A sends to finish it never arrives), relay B delivers its rows, and A gives the dead
    socket up within db_command_timeout (its statement deadline, plus a second for the cancel
    request), says so once, claims again on a new connection and delivers alone."""
    command_timeout = 5.0
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "32 cut off").setup()
    load = checker.writers(writers=2, keys=10, pause=0.01)
    env = {"NOTIFY_OUTBOX_DB_COMMAND_TIMEOUT": str(command_timeout)}
    with _proxy(db_dsn) as proxy:
        scene = _a_stopped_in_a_claim(checker, proxy, services, db_dsn, topic, load, env)
        async with scene as (a, b, tail, _, p, watch, claim):
            # Every connection of A's pool, the claim's among them, goes silent while A is
            # stopped: nothing A sends from now on reaches PostgreSQL.
            silenced = proxy.upstream_ports()
            for port in silenced:
                proxy.silence(port)
            a.signal(signal.SIGCONT)
            # A resumes and sends its batch to Kafka at once; what it sends to PostgreSQL to
            # mark it never arrives. The server's timeout still ends the claim, and B settles
            # the rows (sending them again).
            await _released(watch, claim, "32 relay cut off")
            # Promised: a statement on the silent socket times out after db_command_timeout,
            # and ending the connection waits at most 1 s for asyncpg's cancel request. Timed
            # from when A sent that statement (the proxy saw its first byte), not from the
            # SIGCONT: how long a loaded host takes to resume A is not the relay's. The slack
            # (for a loaded host) stays below the second timeout a ROLLBACK on the dead socket
            # would add.
            bound = command_timeout + 1 + 3
            line = await a.line("PostgreSQL unavailable", within=bound + MARGIN)
            sent = proxy.first_swallowed(silenced)
            assert sent is not None, "relay A gave its connection up without sending on it"
            detected = log_time(line) - sent
            FIGURES.recovery("32 relay cut off: dead socket given up", detected)
            print(f"32: relay A gave its silent claim connection up after {detected:.2f}s: {line}")
            assert detected <= bound, f"relay A gave the dead socket up after {detected:.1f}s"
            # And not before its deadline: the timeout, not something else, ended the wait.
            # (The log's timestamps have millisecond resolution.)
            assert detected >= command_timeout - 0.002, f"given up after {detected:.3f}s"
            await a.line("PostgreSQL available again", within=30)
            # No session of A's is left holding rows (the idle ones stay, unreachable).
            assert not await watch.fetch(_CLAIMS, silenced)
            await load.halt()
            checker.allow_duplicate_ids(claim.held, "relay A's cut-off claim, sent after it ended")
            report = await _a_alone(a, b, p, tail, checker, db_dsn, "32", "reconnected")
    print(f"32: {len(silenced)} connection(s) of relay A silenced")
    print(report.text())
    report.assert_ok()


async def test_33_a_frozen_relays_claim_is_ended_by_the_other_relays_pulse(
    db_dsn: str, services: Services, topic: str
) -> None:
    """As 31, with the relays' pulses on (pulse.py, the default) and a claim idle timeout far
    away (30 s): relay B ends A's claim once it sat idle for frozen_relay_timeout while A's
    pulse was silent as long (not before), and delivers its rows, A still frozen. Resumed, A
    asks before sending, finds its claim gone, says who ended it, and claims again. No event
    is sent twice."""
    # Long enough for the watch to see A's claim before B ends it, on a loaded host too.
    frozen_after = 2.0
    idle_timeout = 30.0
    env = {
        **ENV,
        "NOTIFY_OUTBOX_CLAIM_IDLE_TIMEOUT": str(idle_timeout),
        "NOTIFY_OUTBOX_FROZEN_RELAY_TIMEOUT": str(frozen_after),
    }
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "33 pulse").setup()
    load = checker.writers(writers=2, keys=10, pause=0.01)
    with _proxy(db_dsn) as proxy:
        # The writers go on: B keeps claiming, meets A's keys held, and its pulse beats.
        async with _a_stopped_in_a_claim(checker, proxy, services, db_dsn, topic, load, env) as (
            a,
            b,
            tail,
            _,
            p,
            watch,
            claim,
        ):
            ended = await _released(
                watch,
                claim,
                "33 frozen relay, pulse",
                after=frozen_after,
                by="relay B's pulse",
                setting="frozen_relay_timeout",
            )
            # Not before the timeout (the server's clock on both sides of it), and long
            # before the server's own idle timeout would have.
            assert ended >= frozen_after, f"ended after {ended:.2f}s"
            assert frozen_after + MARGIN < idle_timeout
            assert _stopped(a.proc.pid), "relay A woke up: the test proves nothing"
            a.signal(signal.SIGCONT)
            await a.line("and another relay ended it", within=30)
            await load.halt()
            report = await _a_alone(a, b, p, tail, checker, db_dsn, "33", "resumed")
    print(report.text())
    report.assert_ok()


# Scenario 34: relay A runs STARVED_RUN seconds, then is stopped STARVED_STOP seconds, again and
# again: 25% of a CPU, in stalls twice frozen_relay_timeout (a container at its CPU quota, with
# a long period; SIGSTOP and SIGCONT from the test, so that no cgroup is needed).
STARVED_RUN = 0.1
STARVED_STOP = 0.3
FROZEN_AFTER = 0.15  # frozen_relay_timeout, the default
# A stop in which A's claim sat idle longer than frozen_relay_timeout while A's pulse was
# silent as long: what a peer's pulse ended before a relay's tolerance followed its delays.
_EXPOSED = f"""
SELECT count(*) FROM pg_stat_activity AS w
JOIN pg_stat_activity AS p ON p.datname = w.datname AND p.application_name = $2
WHERE w.datname = current_database() AND w.application_name = $1
  AND w.state = 'idle in transaction'
  AND w.state_change < clock_timestamp() - interval '{FROZEN_AFTER} s'
  AND p.state = 'idle' AND p.state_change < clock_timestamp() - interval '{FROZEN_AFTER} s'
"""
_PULSES = (
    "SELECT application_name, query FROM pg_stat_activity "
    f"WHERE datname = current_database() AND application_name LIKE '{PULSE_APP}/%'"
)


async def test_34_a_relay_starved_of_cpu_keeps_its_claims(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Relays A and B with their pulses on (frozen_relay_timeout 0.15 s), every commit
    notified. Relay A is alive but starved: stopped 0.3 s in every 0.4 s. While events flow
    (on a topic of their own), A's pulse notes how late it wakes and asks, in its
    statements, for three times that before a peer takes it for stopped. Then writers commit
    events over 20 keys, A still starved, until A was stopped inside a claim, its pulse
    silent, for longer than frozen_relay_timeout at least five times (what B's pulse ended
    before): B ends none of A's claims, A loses none, and every event arrives once, in
    per-key order."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "34 starved").setup()
    warm = f"t-{uuid.uuid4().hex[:12]}"
    await create_topics(services.bootstrap, [warm], partitions=3)
    env = {**ENV, "NOTIFY_OUTBOX_FROZEN_RELAY_TIMEOUT": str(FROZEN_AFTER)}
    starving = True
    stops = exposed = 0
    async with connect(db_dsn) as watch:
        # Every commit wakes both relays: A claims whenever it runs (with the gated notify,
        # producers may leave waking to B while B is awake, and A would rest).
        await watch.execute(Queries(OutboxNames())["set_notify_mode"], "always")
    a = FaultRelay(db_dsn, services.bootstrap, env=env, name="relay-a")
    async with relays(a), connect(db_dsn) as watch, connect(db_dsn) as probe:
        await a.ready()
        # A's pulse session opens at its start; A is the only relay yet: its names.
        pulses = await watch.fetch(_PULSES)
        assert len(pulses) == 1, pulses
        a_pulse = pulses[0]["application_name"]
        a_workers = WORKER_APP + a_pulse[len(PULSE_APP) :]
        b = FaultRelay(db_dsn, services.bootstrap, env=env, name="relay-b")
        async with relays(b), task_group() as tg:
            await b.ready()

            async def starve() -> None:
                nonlocal stops, exposed
                # Load shaping by the clock, as a CPU quota does: the fault, not a wait for it.
                while starving:
                    a.signal(signal.SIGSTOP)
                    try:
                        stops += 1
                        await anyio.sleep(STARVED_STOP - 0.05)
                        if await probe.fetchval(_EXPOSED, a_workers, a_pulse):
                            exposed += 1
                        await anyio.sleep(0.05)
                    finally:
                        a.signal(signal.SIGCONT)
                    await anyio.sleep(STARVED_RUN)

            warm_up = checker.writers(topic=warm, writers=2, keys=20, pause=0.005, seed=7)
            tg.start_soon(warm_up.run)
            tg.start_soon(starve)
            # A's pulse wakes late, by a stop's length: its log says what it asks for now,
            # and its statements carry it (B's pulse reads it there).
            await a.line(r"end its claims after (0\.[6-9]\d|[1-9]\.\d\d)s of silence", within=60)

            async def carried() -> bool:
                query = next(r["query"] for r in await watch.fetch(_PULSES) if r[0] == a_pulse)
                tag = query.removeprefix("/* notify-outbox tolerance_ms=").split(" ", 1)[0]
                return tag.isdigit() and int(tag) >= 600

            await eventually(carried, within=30, what="relay A's pulse carries its tolerance")
            await warm_up.halt()
            # What was ended so far (the first stalls, before A knew it was starved) is not
            # this test's business; from here on nothing may be.
            ended_before = len(b.matching(r"ended \d+ claim"))
            lost_before = len(a.matching("another relay ended it|PostgreSQL unavailable"))
            stops_before, exposed_before = stops, exposed
            load = checker.writers(writers=4, keys=20, pause=0.005)
            tg.start_soon(load.run)
            feeding = True
            fed = anyio.Event()

            async def feed() -> None:
                # A backlog all along, so that A claims (and waits for acks) whenever it
                # runs: batches of 100 events (5 per key) 10 times a second, load shaping.
                try:
                    async with checker.producer() as p:
                        while feeding:
                            await p.bulk([f"key-{i % 20}" for i in range(100)])
                            await anyio.sleep(0.1)
                finally:
                    fed.set()

            tg.start_soon(feed)

            def ended() -> list[str]:
                return b.matching(r"ended \d+ claim")[ended_before:]

            def lost() -> list[str]:
                return a.matching("another relay ended it|PostgreSQL unavailable")[lost_before:]

            async def exposed_enough() -> bool:
                # Five such stops, or a claim of A ended (fails below, without waiting on).
                return exposed - exposed_before >= 5 or bool(ended() or lost())

            await eventually(
                exposed_enough,
                within=120,
                what="relay A was stopped inside a claim, its pulse silent, for longer than "
                "frozen_relay_timeout five times",
            )
            feeding = False
            await load.halt()
            with anyio.fail_after(30):
                await fed.wait()
            starving = False
            report = await checker.drain_and_check(within=60)
            ended_by_b, lost_by_a = ended(), lost()
            await b.stop_ok()
        await a.stop_ok()
    print(
        f"34: relay A stopped {stops - stops_before} times while {load.produced} events were "
        f"written, {exposed - exposed_before} of them inside a claim with its pulse silent "
        f"beyond {FROZEN_AFTER}s; relay B ended {len(ended_by_b)} of its claims"
    )
    print(report.text())
    assert not ended_by_b, f"relay B ended claims of the starved relay A: {ended_by_b}"
    assert not lost_by_a, f"relay A lost claims: {lost_by_a}"
    report.assert_ok()
