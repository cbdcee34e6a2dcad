"""Faults on the LISTEN path.

Scenarios (reliability.md): 3 spoofed NOTIFY by another role, 5 ``pg_terminate_backend`` on the
listener while writers insert, 6 a listener socket that silently stops carrying bytes.
"""

from __future__ import annotations

import re
import time
import uuid
from urllib.parse import urlsplit

import anyio
import asyncpg
import pytest

from devstack._common import free_ports
from notify_outbox import OutboxSettings, Relay
from tests.conftest import Services
from tests.faults.checker import FIGURES, OutboxChecker
from tests.faults.harness import (
    LISTENER_APP,
    FaultRelay,
    KafkaTail,
    SilentProxy,
    connect,
    dsn_with_port,
    eventually,
    idle_latency,
    listener_count,
    log_time,
    relays,
    task_group,
    terminate_listeners,
)
from tests.support import dsn_with_user, metric

pytestmark = pytest.mark.anyio


async def test_03_spoofed_notify_by_another_role_is_harmless(
    db_dsn: str, services: Services, topic: str
) -> None:
    """A role with no grant at all NOTIFYs the relay's channel with junk, with fake and
    replayed health-probe tokens, and with payloads at the size limit. The relay wakes up,
    finds nothing, publishes nothing extra, and never takes its listener for dead."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "3 spoofed NOTIFY").setup()
    role = f"spoofer_{uuid.uuid4().hex[:8]}"
    async with connect(db_dsn) as admin:
        await admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'spoof'")
    settings = OutboxSettings.model_validate(
        {
            "dsn": db_dsn,
            "kafka_bootstrap_servers": services.bootstrap,
            "poll_interval": 30.0,
            "listen_health_interval": 0.3,  # many real probes interleave with the fake ones
            "listen_health_timeout": 2.0,
        }
    )
    try:
        spoofer = await asyncpg.connect(dsn_with_user(db_dsn, role, "spoof"))
        async with Relay(settings) as relay, checker.producer() as p:
            # The spoofer also listens, so it can replay the relay's real probe tokens.
            probes: list[str] = []
            got_probe = anyio.Event()

            def overheard(_c: object, _pid: int, _ch: str, payload: str) -> None:
                if payload.startswith("notify-outbox-probe:"):
                    probes.append(payload)
                    got_probe.set()

            await spoofer.add_listener("notify_outbox", overheard)
            with anyio.fail_after(10):
                await got_probe.wait()
            junk = [
                "",
                "x",
                '{"id": 1, "topic": "orders", "payload": {}}',
                "'; DELETE FROM outbox; --",
                "ünïcødé ✓",
                "y" * 7999,
                "notify-outbox-probe:",
                "notify-outbox-probe:0000000000000000",
                "notify-outbox-probe:" + "z" * 7970,
                probes[0],  # a replayed real token
                "public.outbox",  # the relay's own outbox named (migration 0008): a hint only
            ]
            before = [await p.produce(f"key-{i % 5}") for i in range(20)]
            await checker.drain_and_check(within=30, record=False)
            heard, claimed = (relay.events.counts[n] for n in ("wake:notification", "claimed"))
            # With no legit traffic now, every wake-up counted comes from the spoofer.
            for i in range(10):
                for payload in junk:
                    await spoofer.execute("SELECT pg_notify('notify_outbox', $1)", payload)
                await spoofer.execute(f"NOTIFY notify_outbox, 'plain-notify-{i}'")
            # Only the empty payload and the outbox's own name wake the relay: a payload naming
            # anything else is another outbox's news (migration 0008) and is ignored. A last
            # empty one, delivered after every other, says they have all been handled.
            spoofed = 10 * 2
            await spoofer.execute("SELECT pg_notify('notify_outbox', '')")
            with anyio.move_on_after(30):
                await relay.events.wait_for("wake:notification", heard + spoofed + 1)
            counts = relay.events.counts.copy()
            assert counts["wake:notification"] == heard + spoofed + 1, counts
            assert counts["claimed"] == claimed, "a spoofed wake-up claimed something"
            after = [await p.produce(f"key-{i % 5}") for i in range(10)]
            legit = before + after
            report = await checker.drain_and_check(within=60)
            counts = relay.events.counts.copy()
        await spoofer.close()
    finally:
        async with connect(db_dsn) as admin:
            await admin.execute(f"DROP ROLE IF EXISTS {role}")
    print(report.text())
    assert counts["listener_lost"] == 0, counts
    assert counts["claimed"] == len(legit), counts
    assert counts.get("dead_lettered", 0) == 0
    assert report.messages == len(legit)
    report.assert_ok()


async def test_05_listener_backend_terminated_while_writers_insert(
    db_dsn: str, services: Services, topic: str
) -> None:
    """The listener's backend is terminated three times, each after a burst of writers. The
    writers stop before each kill, so that no later notification can claim in the catch-up's
    place: the relay reconnects, LISTENs again and catches up alone, and an event committed
    right after the kill (its notification has nobody to hear it) arrives without the fallback
    poll (600 s away; the relay's own counters show that it never ran)."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "5 listener kill").setup()
    port = free_ports(1)[0]
    env = {
        "NOTIFY_OUTBOX_POLL_INTERVAL": "600",
        "NOTIFY_OUTBOX_HTTP_PORT": str(port),
        # The listener waits 2 s before it reconnects, so that the marker surely commits
        # while nobody listens (at 0.05 s the new LISTEN could come first and hear it).
        "NOTIFY_OUTBOX_RECONNECT_MIN_DELAY": "2",
        "NOTIFY_OUTBOX_RECONNECT_MAX_DELAY": "2",
        # A claim that found other claims busy wakes the relay again after 1.1 x this (a
        # "retry" wake-up): far away, so that no such timer claims the marker instead.
        "NOTIFY_OUTBOX_CLAIM_IDLE_TIMEOUT": "300",
    }
    async with (
        relays(FaultRelay(db_dsn, services.bootstrap, env=env)) as (relay,),
        KafkaTail(services.bootstrap, [topic]) as tail,
        checker.producer() as p,
        connect(db_dsn) as watch,
    ):
        await relay.ready()
        for kill in range(1, 4):
            load = checker.writers(writers=3, keys=15, pause=0.01, seed=kill)
            async with task_group() as tg:
                tg.start_soon(load.run)
                await eventually(
                    lambda: _at_least(load.produced, 100),  # noqa: B023
                    within=60,
                    what=f"writers ran before listener kill {kill}",
                )
                await load.halt()
            # And the relay has gone to sleep: nothing pending, and its listening session holds
            # no awake marker (workers still draining would claim the marker themselves).
            await eventually(
                lambda: _asleep(watch), within=60, what=f"the relay sleeps before kill {kill}"
            )
            killed_at = time.monotonic()
            assert await terminate_listeners(db_dsn) == 1
            marker = await p.produce("marker")
            await relay.line("listener connection lost", count=kill, within=30)
            arrived = await tail.wait_for(
                [marker], within=60, what=f"marker after listener kill {kill}"
            )
            FIGURES.recovery("listener kill", arrived - killed_at)
            await eventually(lambda: _one_listener(db_dsn), within=30, what="the listener is back")
            # I6: the listening connection never sits inside a transaction.
            state = await watch.fetchval(
                "SELECT state FROM pg_stat_activity WHERE application_name = $1 "
                "AND datname = current_database()",
                LISTENER_APP,
            )
            assert state in ("idle", "active"), f"listener state {state!r}"
        await idle_latency(db_dsn, lambda: p.produce("idle"), tail, what="after listener kills")
        report = await checker.drain_and_check(within=60)
        wakeups = {
            source: await anyio.to_thread.run_sync(
                lambda: metric(port, "notify_outbox_wakeups_total", source=source)  # noqa: B023
            )
            for source in ("reconnect", "poll")
        }
        await relay.stop_ok()
    print(report.text())
    print(f"wake-ups: {wakeups}")
    assert wakeups == {"reconnect": 3, "poll": 0}, wakeups
    assert report.duplicates == 0
    report.assert_ok()


async def _live_listener_port(
    watch: asyncpg.Connection, silenced: list[int], *, established: bool = False
) -> int:
    """The client port of the relay's listening connection that is not silenced (the
    silenced ones linger server-side, as they would behind a dead network path).
    ``established``: only once it has LISTENed (its last statement is the LISTEN, a health
    probe or a gate statement, which all come after the LISTEN)."""
    port = 0

    async def found() -> bool:
        nonlocal port
        rows = await watch.fetch(
            "SELECT client_port, query FROM pg_stat_activity WHERE application_name = $1 "
            "AND datname = current_database() AND NOT client_port = ANY($2::int[])",
            LISTENER_APP,
            silenced,
        )
        assert len(rows) <= 1, f"more than one live listener: {rows}"
        if rows and (
            not established or re.match(r"(?is)\s*LISTEN|.*(pg_notify|advisory)", rows[0]["query"])
        ):
            port = int(rows[0]["client_port"])
            return True
        return False

    await eventually(found, within=30, what="a live listening connection")
    return port


async def _at_least(value: int, target: int) -> bool:
    return value >= target


async def _asleep(watch: asyncpg.Connection) -> bool:
    """No row pending, and the relay's listening session holds no advisory lock (the gate's
    awake marker, taken while it drains)."""
    return bool(
        await watch.fetchval(
            "SELECT NOT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL) "
            "AND NOT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE a.application_name = $1 AND a.datname = current_database() "
            "AND l.locktype = 'advisory' AND l.granted)",
            LISTENER_APP,
        )
    )


async def _one_listener(dsn: str) -> bool:
    return await listener_count(dsn) == 1


async def test_06_silently_dead_listener_socket_is_detected_by_the_probe(
    db_dsn: str, services: Services, topic: str
) -> None:
    """The relay reaches PostgreSQL through a proxy; the listener's connection goes silent
    (bytes swallowed both ways, nothing closed: TCP would not notice for many minutes, and the
    server keeps the session, with any lock it holds). The health probe must notice within
    listen_health_interval + listen_health_timeout; a replacement connection that dies during
    its set-up must be given up within db_command_timeout; then the relay catches up, and an
    event committed on the idle relay is woken for at once (no ghost session may keep
    producers from notifying)."""
    interval, timeout, db_timeout = 1.0, 1.0, 5.0
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "6 dead socket").setup()
    load = checker.writers(writers=2, keys=10, pause=0.01)
    parts = urlsplit(db_dsn)
    env = {
        "NOTIFY_OUTBOX_LISTEN_HEALTH_INTERVAL": str(interval),
        "NOTIFY_OUTBOX_LISTEN_HEALTH_TIMEOUT": str(timeout),
        "NOTIFY_OUTBOX_DB_COMMAND_TIMEOUT": str(db_timeout),
    }
    with SilentProxy(parts.hostname or "127.0.0.1", parts.port or 5432) as proxy:
        relay_dsn = dsn_with_port(db_dsn, "127.0.0.1", proxy.port)
        async with (
            relays(FaultRelay(relay_dsn, services.bootstrap, env=env)) as (relay,),
            KafkaTail(services.bootstrap, [topic]) as tail,
            task_group() as tg,
            checker.producer() as p,
            connect(db_dsn) as watch,
        ):
            await relay.ready()
            tg.start_soon(load.run)
            silenced: list[int] = []
            # Round 1: an established listener goes silent. Round 2: the same, and the
            # connection that replaces it goes silent as soon as its start-up completes,
            # before it could LISTEN: the relay's first statements on it vanish too.
            lost = 0
            for n in (1, 2):
                port = await _live_listener_port(watch, silenced, established=True)
                if n == 2:
                    proxy.silence_next(LISTENER_APP.encode())
                proxy.silence(port)
                silenced.append(port)
                at, at_mono = time.time(), time.monotonic()
                marker = await p.produce("marker")  # its notification is swallowed
                lost += 1
                # Promised: within listen_health_interval + listen_health_timeout (2 s here);
                # without the probe, TCP would not notice for many minutes. The wait is
                # generous (load slows any process down); the time taken is a figure.
                line = await relay.line("listener connection lost", count=lost, within=20)
                detected = log_time(line) - at
                FIGURES.recovery("dead socket: detection", detected)
                if n == 2:
                    await eventually(
                        lambda: _at_least(len(proxy.silenced_at_startup), 1),
                        within=15,
                        what="the relay reconnected (and that connection went silent)",
                    )
                    at = time.time()
                    silenced += proxy.silenced_at_startup
                    lost += 1
                    # Given up within db_command_timeout (5 s) as promised, or it would hang
                    # for good: a generous wait, the time taken a figure.
                    line = await relay.line("listener connection lost", count=lost, within=30)
                    stuck = log_time(line) - at
                    FIGURES.recovery("dead socket: detection during set-up", stuck)
                arrived = await tail.wait_for([marker], within=30, what="marker after reconnect")
                FIGURES.recovery("dead socket", arrived - at_mono)
                with anyio.fail_after(10):
                    await _live_listener_port(watch, silenced)
            await load.halt()
            await idle_latency(db_dsn, lambda: p.produce("idle"), tail, what="after dead sockets")
            report = await checker.drain_and_check(within=60)
            await relay.stop_ok()
    print(report.text())
    assert report.duplicates == 0
    report.assert_ok()
