"""Scenario 27: a relay frozen (SIGSTOP: a VM stall, a debugger, a long pause) while it holds
the gated notify's awake marker must not silence the producers for the other relays.

Since migration 0006 the marker is a lock on the current epoch (25 ms), renewed only while the
relay makes progress: a frozen relay stops renewing it, producers notify again within two
epochs, and the other relay claims what they commit. Before, the frozen relay kept the marker
for as long as it was frozen, producers kept skipping their NOTIFY, and the other relay found
the rows only at its fallback poll (here 300 s away: the test would time out).
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import anyio
import pytest

from notify_outbox import OutboxNames
from tests.conftest import Services
from tests.faults.checker import OutboxChecker
from tests.faults.harness import FaultRelay, KafkaTail, connect, eventually, relays, task_group

pytestmark = pytest.mark.anyio

# The marker's locks in pg_locks: two-key advisory locks of the awake namespace.
_MARKER_HOLDERS = (
    "SELECT array_agg(DISTINCT pid) FROM pg_locks WHERE locktype = 'advisory' AND granted "
    "AND objsubid = 2 AND classid::bigint = $1"
)
_LISTENER_PIDS = (
    "SELECT array_agg(pid) FROM pg_stat_activity "
    "WHERE application_name = 'notify-outbox-listener' AND datname = current_database()"
)


async def test_27_a_frozen_relay_does_not_silence_the_producers(
    db_dsn: str, services: Services, topic: str
) -> None:
    env = {
        "NOTIFY_OUTBOX_POLL_INTERVAL": "300",  # delivery during the freeze cannot be the poll
        "NOTIFY_OUTBOX_GATE_AWAKE_AFTER": "0",
        "NOTIFY_OUTBOX_GATE_AWAKE_RATE": "0",
        # A frozen claim keeps its rows' key buckets (keyless rows: id mod 256): small batches
        # keep what the frozen relay holds small.
        "NOTIFY_OUTBOX_BATCH_SIZE": "5",
    }
    awake_ns = OutboxNames().awake_namespace & 0xFFFFFFFF  # pg_locks shows it as an oid
    committed: dict[str, str] = {}  # event id -> "before", "frozen" or "after"
    phase = "before"
    stop = anyio.Event()

    async def produce() -> None:
        async with connect(db_dsn) as conn:
            while not stop.is_set():
                event_id = str(uuid.uuid4())
                await conn.execute(
                    "INSERT INTO outbox (event_id, topic, payload) VALUES ($1, $2, '{}')",
                    event_id,
                    topic,
                )
                committed[event_id] = phase
                await anyio.sleep(0.003)

    a = FaultRelay(db_dsn, services.bootstrap, env=env, name="relay-a")
    async with (
        relays(a),
        KafkaTail(services.bootstrap, [topic]) as tail,
        task_group() as tg,
        connect(db_dsn) as admin,
    ):
        await a.ready()
        tg.start_soon(produce)
        # Under steady traffic A marks itself awake: producers stop notifying.
        a_listener: list[int] = []

        async def a_holds_the_marker() -> bool:
            nonlocal a_listener
            a_listener = await admin.fetchval(_LISTENER_PIDS) or []
            holders = await admin.fetchval(_MARKER_HOLDERS, awake_ns) or []
            return len(a_listener) == 1 and holders == a_listener

        await eventually(a_holds_the_marker, within=30, what="relay A holds the awake marker")
        b = FaultRelay(db_dsn, services.bootstrap, env=env, name="relay-b")
        async with relays(b):
            await b.ready()

            async def only_a_holds_it() -> bool:
                holders = await admin.fetchval(_MARKER_HOLDERS, awake_ns) or []
                return holders == a_listener

            # Freeze A at a moment it holds the marker (B may take an epoch now and then).
            await eventually(only_a_holds_it, within=30, what="relay A holds the marker alone")
            a.signal(signal.SIGSTOP)
            phase = "frozen"
            try:

                async def frozen_commits() -> bool:
                    return sum(p == "frozen" for p in committed.values()) >= 300

                await eventually(frozen_commits, within=30, what="300 commits during the freeze")
                during = [e for e, p in committed.items() if p == "frozen"]

                # B delivers what producers commit while A is frozen, A still frozen. Rows in
                # the key buckets of A's frozen claim (at most 5 of 256) wait for A.
                async def most_arrived() -> bool:
                    return sum(e in tail.first_seen for e in during) >= 0.9 * len(during)

                await eventually(
                    most_arrived,
                    within=20,
                    what="most events committed while relay A was frozen reached Kafka (the "
                    "producers must wake relay B)",
                )
            finally:
                a.signal(signal.SIGCONT)
            phase = "after"
            stop.set()
            await tail.wait_for(committed, within=60, what="every committed event")
            await b.stop_ok()
        await a.stop_ok()
    print(f"scenario 27: {len(committed)} events, {len(during)} while relay A was frozen")


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): state T in /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


async def test_27b_a_relay_frozen_inside_its_claim_gives_its_keys_up(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Relay A freezes right after it claimed a batch (holding its keys). PostgreSQL ends A's
    claim after ``claim_idle_timeout`` (1 s here) of silence, and relay B delivers those keys
    too while A is still frozen. Resumed, A finds its claim gone: what it still sends of its
    batch are duplicates of what B sent (allowed), and every key keeps its commit order."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "27b frozen claim").setup()
    env = {"NOTIFY_OUTBOX_CLAIM_IDLE_TIMEOUT": "1", "NOTIFY_OUTBOX_BATCH_SIZE": "20"}
    async with checker.producer() as p, KafkaTail(services.bootstrap, [topic]) as tail:
        first = [await p.produce(f"key-{i % 10}") for i in range(40)]
        a = FaultRelay(
            db_dsn,
            services.bootstrap,
            env={**env, "NOTIFY_OUTBOX_TEST_STOP_AT": "after_claim"},
            name="relay-a",
        )
        async with relays(a):

            async def a_frozen() -> bool:
                return _stopped(a.proc.pid)

            await eventually(a_frozen, within=60, what="relay A froze in a claim")
            b = FaultRelay(db_dsn, services.bootstrap, env=env, name="relay-b")
            async with relays(b):
                await b.ready()
                later = [await p.produce(f"key-{i % 10}") for i in range(40)]
                # The bound is the point here: 1 s of claim_idle_timeout, with room for a
                # loaded machine; without it the frozen claim held its keys for as long as the
                # freeze (or kafka_send_timeout + 2 * db_command_timeout: 15 s in these tests).
                await tail.wait_for(
                    first + later,
                    within=10,
                    what="relay B delivers every key, those of A's frozen claim too",
                )
                assert _stopped(a.proc.pid), "relay A woke up: the test proves nothing"
                a.signal(signal.SIGCONT)
                checker.allow_duplicates(a.in_flight_bound, "relay A's claims, sent after they end")
                report = await checker.drain_and_check(within=60)
                await b.stop_ok()
            await a.stop_ok()
    print(report.text())
    report.assert_ok()
