"""The relay, the producer API and the CLI through a real PgBouncer, in transaction and in
session pooling, configured as deployed (``ignore_startup_parameters = extra_float_digits``).

Transaction pooling hands the server session to other clients between transactions: named
prepared statements, session settings, LISTEN and session-level locks do not survive it.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import defaultdict
from typing import Any

import anyio
import asyncpg
import pytest

from devstack.relayproc import RelayProcess, child_env, cli_argv
from notify_outbox import ConfigurationError, OutboxSettings, Relay, enqueue
from tests.conftest import Services
from tests.pooling import Poolers
from tests.support import consume, header, topic_total

pytestmark = pytest.mark.anyio

WRITERS = 6
TXS_PER_WRITER = 40
KEYS_PER_WRITER = 4


def _settings(dsn: str, services: Services, **kw: Any) -> OutboxSettings:
    base: dict[str, Any] = {
        "dsn": dsn,
        "kafka_bootstrap_servers": services.bootstrap,
        "workers": 4,
        "batch_size": 50,
        "poll_interval": 30.0,  # long: delivery must not depend on the fallback poll
        "gate_awake_after": 0.0,  # take part in the gated notify at once, where allowed
        "gate_awake_rate": 0.0,
    }
    base.update(kw)
    return OutboxSettings(**base)


async def _write(dsn: str, topic: str) -> dict[str, tuple[str, int]]:
    """Concurrent producers through ``dsn`` (asyncpg without a statement cache, as the docs
    tells pooler users): each writer owns its keys and numbers their events. Returns event id
    -> (key, sequence number)."""
    committed: dict[str, tuple[str, int]] = {}

    async def writer(w: int) -> None:
        conn = await asyncpg.connect(dsn, statement_cache_size=0)
        seq: dict[str, int] = defaultdict(int)
        try:
            for t in range(TXS_PER_WRITER):
                batch = []
                async with conn.transaction():
                    for j in range(3):
                        key = f"w{w}-k{(t + j) % KEYS_PER_WRITER}"
                        seq[key] += 1
                        event_id = await enqueue(
                            conn, topic=topic, key=key, payload={"seq": seq[key]}
                        )
                        batch.append((str(event_id), key, seq[key]))
                for event_id, key, n in batch:  # recorded only once committed
                    committed[event_id] = (key, n)
        finally:
            await conn.close()

    async with anyio.create_task_group() as tg:
        for w in range(WRITERS):
            tg.start_soon(writer, w)
    return committed


def _check_order(records: list[Any], committed: dict[str, tuple[str, int]]) -> None:
    per_key: dict[str, list[int]] = defaultdict(list)
    for record in records:
        key, n = committed[header(record, "outbox-event-id") or ""]
        assert record.key == key.encode()
        assert json.loads(record.value)["seq"] == n
        per_key[key].append(n)
    assert len(per_key) == WRITERS * KEYS_PER_WRITER
    for key, seqs in per_key.items():
        assert seqs == list(range(1, len(seqs) + 1)), f"{key} out of commit order: {seqs}"


async def test_relay_delivers_every_event_in_key_order_through_pgbouncer(
    request: pytest.FixtureRequest, pooled_dsn: str, db_dsn: str, services: Services, topic: str
) -> None:
    """Workers, producers and (in session pooling) the listener all go through PgBouncer; in
    transaction pooling the one listening connection goes to PostgreSQL itself
    (NOTIFY_OUTBOX_LISTEN_DSN). Every event arrives once, in per-key commit order, woken by
    notifications."""
    mode = request.node.callspec.params["pooled_dsn"]
    listen = {"listen_dsn": db_dsn} if mode == "transaction" else {}
    async with Relay(_settings(pooled_dsn, services, **listen)) as relay:
        assert relay.behind_pooler
        assert relay.pulse is None, "a pooler's server sessions are not the relay's: no pulse"
        committed = await _write(pooled_dsn, topic)
        records, _ = await consume(services.bootstrap, topic, expect=len(committed))
    total = await topic_total(services.bootstrap, topic)  # the relay stopped
    assert total == len(committed) == WRITERS * TXS_PER_WRITER * 3
    _check_order(records, committed)
    assert relay.events.counts["wake:notification"] >= 1
    assert relay.events.counts["wake:poll"] == 0
    assert relay.listener is not None
    if mode == "session":
        # The awake marker is a session-level lock: through a pooler it could outlive the
        # relay, so the relay never takes it there (producers always notify).
        assert not relay.listener.direct
        assert relay.events.counts["gate_awake"] == 0
    else:
        assert relay.listener.direct


async def test_poll_only_through_transaction_pooling(
    poolers: Poolers, db_dsn: str, services: Services, topic: str
) -> None:
    """The case that used to crash at once (DuplicatePreparedStatementError): poll-only with
    every connection through a transaction pooler."""
    dsn = poolers.dsn_through("transaction", db_dsn)
    async with Relay(_settings(dsn, services, poll_only=True, poll_interval=0.1)) as relay:
        committed = await _write(dsn, topic)
        records, _ = await consume(services.bootstrap, topic, expect=len(committed))
    total = await topic_total(services.bootstrap, topic)  # the relay stopped
    assert total == len(committed)
    _check_order(records, committed)
    assert relay.events.counts["wake:poll"] >= 1
    assert relay.outcome == "stopped"


async def test_listen_through_transaction_pooling_is_refused_with_the_fix(
    poolers: Poolers, db_dsn: str, services: Services
) -> None:
    """LISTEN through a transaction pooler hears nothing: the relay finds out at start and
    refuses, naming both fixes, instead of running deaf until the fallback poll."""
    dsn = poolers.dsn_through("transaction", db_dsn)
    with pytest.raises(ConfigurationError) as caught:
        async with Relay(_settings(dsn, services)):
            pass
    message = str(caught.value)
    assert "NOTIFY_OUTBOX_LISTEN_DSN" in message
    assert "NOTIFY_OUTBOX_POLL_ONLY=true" in message

    # The poll interval as in _settings: this test is about the refusal, and a poll ending
    # mid-statement is the subject of test_a_relay_aborted_mid_statement_leaves_the_pooler_alive.
    env = {"NOTIFY_OUTBOX_DSN": dsn, "NOTIFY_OUTBOX_POLL_INTERVAL": "30", **_kafka(services)}
    result = _cli("run", env=env)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "notify-outbox:" in line]
    assert len(errors) == 1, result.stderr
    assert "NOTIFY_OUTBOX_LISTEN_DSN" in errors[0], result.stderr


async def test_connection_errors_that_never_heal_stop_the_relay_with_the_reason(
    poolers: Poolers, db_dsn: str, services: Services
) -> None:
    """A database that does not exist (here behind the pooler) is not an outage: the relay
    does not retry it forever but stops with one line saying what is wrong."""
    missing = db_dsn.rsplit("/", 1)[0] + "/no_such_database"
    dsn = poolers.dsn_through("transaction", missing)
    started = time.monotonic()
    with pytest.raises(ConfigurationError, match="does not exist"):
        async with Relay(_settings(dsn, services, poll_only=True)):
            pass
    assert time.monotonic() - started < 10
    result = _cli("run", env={"NOTIFY_OUTBOX_DSN": dsn, **_kafka(services)})
    assert result.returncode == 2, result.stderr
    assert "does not exist" in result.stderr


@pytest.mark.parametrize(
    "command",
    [("migrate",), ("migrate", "--check"), ("verify",), ("status",), ("notify-mode",)],
    ids=lambda c: " ".join(c),
)
async def test_cli_commands_through_pgbouncer(pooled_dsn: str, command: tuple[str, ...]) -> None:
    """Each command twice in a row: a cached prepared statement would break the second run
    in transaction pooling."""
    for _ in range(2):
        result = _cli(*command, env={"NOTIFY_OUTBOX_DSN": pooled_dsn})
        assert result.returncode == 0, result.stderr


def _kafka(services: Services) -> dict[str, str]:
    return {"NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.bootstrap}


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli_argv(*args), capture_output=True, text=True, env=child_env(**env), timeout=60
    )


async def test_a_relay_aborted_mid_statement_leaves_the_pooler_alive(
    poolers: Poolers, db_dsn: str, services: Services
) -> None:
    """A relay aborted while its statements run sends cancel requests; ending its connections
    (or the process) before those went out kills PgBouncer < 1.19.1, and every client with it
    (pgbouncer#801). Here the relay's statements wait on a lock the test holds, so a cancel is
    certain; two SIGTERMs abort the relay process. The conftest guard fails the test if the
    pooler died; the last statement proves it still serves."""
    dsn = poolers.dsn_through("transaction", db_dsn)
    env = {"NOTIFY_OUTBOX_POLL_ONLY": "true", "NOTIFY_OUTBOX_POLL_INTERVAL": "0.05"}
    locker = await asyncpg.connect(db_dsn)
    try:
        for _ in range(3):
            await locker.execute("BEGIN; LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
            with RelayProcess(dsn, services.bootstrap, env=env, name="aborted") as relay:
                # No event says "a statement waits for the lock": the server's lock table does,
                # asked every 20 ms within a deadline.
                with anyio.fail_after(30):
                    while not await locker.fetchval(  # noqa: ASYNC110
                        "SELECT count(*) FROM pg_locks WHERE NOT granted "
                        "AND relation = 'outbox'::regclass"
                    ):
                        await anyio.sleep(0.02)
                relay.signal()
                # The second signal only after the first was handled (signals do not queue).
                await anyio.to_thread.run_sync(relay.wait_for_line, "stopping", 10.0)
                relay.signal()
                code = await anyio.to_thread.run_sync(relay.wait, 30.0)
                assert code == 130, relay.output()
            await locker.execute("ROLLBACK")
    finally:
        await locker.close()
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        assert await conn.fetchval("SELECT 1") == 1
    finally:
        await conn.close()
