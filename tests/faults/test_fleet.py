"""Scenario 36, many outboxes (issue #34, item 7): three relay processes, each serving every
outbox of the database (``NOTIFY_OUTBOX_OUTBOXES=*``), share 50 tenants' outboxes while writers
commit keyed events into all of them; one process is killed with SIGKILL mid-run and a new one
added. Nothing committed is lost, and each (outbox, key)'s events arrive in commit order."""

from __future__ import annotations

import itertools
import json
import random
import time
from collections import defaultdict

import anyio
import asyncpg
import pytest

from notify_outbox import OutboxNames, migrate
from tests.conftest import Services
from tests.faults.harness import FaultRelay, eventually, relays, task_group
from tests.support import consume, topic_total

pytestmark = pytest.mark.anyio

OUTBOXES = [f"t{i:02d}" for i in range(50)]
EVENTS = 6000
WRITERS = 4
KEYS_PER_OUTBOX = 4
KILL_AT, ADD_AT = 1500, 3000  # events committed
FLEET_ENV = {
    "NOTIFY_OUTBOX_OUTBOXES": "*",
    "NOTIFY_OUTBOX_WORKERS": "4",  # a pool of 6 per process, 2 workers per outbox
    "NOTIFY_OUTBOX_BATCH_SIZE": "50",
}
READY = "fleet running"


async def _pending(dsn: str) -> int:
    union = " UNION ALL ".join(
        f'SELECT count(*) AS n FROM "{s}".outbox WHERE published_at IS NULL' for s in OUTBOXES
    )
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(f"SELECT sum(n) FROM ({union}) AS u"))
    finally:
        await conn.close()


async def test_three_fleet_processes_share_fifty_outboxes_through_a_kill_and_an_addition(
    empty_db_dsn: str, services: Services, topic: str
) -> None:
    seed = random.randrange(1 << 30)
    print(f"[fleet] seed {seed}")
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        for schema in OUTBOXES:
            await migrate(conn, OutboxNames(schema))
        # A per-key counter bumped in each producing transaction: its row lock is held until
        # commit, so a key's numbers follow its commit order (whatever the outbox ids).
        await conn.execute("CREATE TABLE fleet_seq (k text PRIMARY KEY, n integer NOT NULL)")
    finally:
        await conn.close()

    committed: list[tuple[str, int]] = []  # (key, seq) of every commit
    spawned: list[FaultRelay] = []

    def spawn() -> FaultRelay:
        relay = FaultRelay(
            empty_db_dsn, services.bootstrap, env=FLEET_ENV, name=f"fleet-{len(spawned) + 1}"
        )
        spawned.append(relay)
        return relay

    async def writer(n: int) -> None:
        rng = random.Random(seed + n)
        conn = await asyncpg.connect(empty_db_dsn)
        try:
            while len(committed) < EVENTS:
                schema = rng.choice(OUTBOXES)
                key = f"{schema}-k{rng.randrange(KEYS_PER_OUTBOX)}"
                async with conn.transaction():
                    seq = await conn.fetchval(
                        "INSERT INTO fleet_seq VALUES ($1, 1) ON CONFLICT (k) DO UPDATE "
                        "SET n = fleet_seq.n + 1 RETURNING n",
                        key,
                    )
                    await conn.execute(
                        f'INSERT INTO "{schema}".outbox (topic, key, payload) VALUES ($1, $2, $3)',
                        topic,
                        key,
                        json.dumps({"seq": seq}),
                    )
                committed.append((key, seq))
                await anyio.sleep(0.001)
        finally:
            await conn.close()

    async def reached(n: int) -> bool:
        return len(committed) >= n

    first = [spawn() for _ in range(3)]
    async with relays(*first) as procs, task_group() as tg:
        for relay in procs:
            await relay.line(READY)
        started = time.monotonic()
        for n in range(WRITERS):
            tg.start_soon(writer, n)
        await eventually(lambda: reached(KILL_AT), within=60, what=f"{KILL_AT} commits")
        victim = procs[random.Random(seed).randrange(3)]
        await victim.kill()
        killed_at = len(committed)
        await eventually(lambda: reached(ADD_AT), within=60, what=f"{ADD_AT} commits")
        added = spawn()
        async with relays(added):
            await added.line(READY)
            added_at = len(committed)
            await eventually(lambda: reached(EVENTS), within=120, what="every commit")

            async def drained() -> bool:
                return await _pending(empty_db_dsn) == 0

            await eventually(drained, within=120, what="every outbox drained", interval=0.2)
            took = time.monotonic() - started
            for relay in [*procs, added]:
                if relay is not victim:
                    await relay.stop_ok()
    total = await topic_total(services.bootstrap, topic)
    records, _ = await consume(services.bootstrap, topic, expect=total)

    # Per key: the first arrival of each seq, in offset order (a key has one partition).
    arrivals: dict[str, list[int]] = defaultdict(list)
    seen: set[tuple[str, int]] = set()
    for record in records:
        key, seq = record.key.decode(), json.loads(record.value)["seq"]
        if (key, seq) not in seen:
            seen.add((key, seq))
            arrivals[key].append(seq)
    lost = set(committed) - seen
    phantom = seen - set(committed)
    inversions = sum(1 for seqs in arrivals.values() for a, b in itertools.pairwise(seqs) if b < a)
    outboxes = {key.split("-")[0] for key, _ in seen}
    print(
        f"[fleet] {len(committed)} committed in 50 outboxes, {total} messages, "
        f"{total - len(seen)} duplicates, {len(lost)} lost, {len(phantom)} phantom, "
        f"{inversions} order inversions; killed {victim.name} at {killed_at} commits, added "
        f"{added.name} at {added_at}; {took:.1f}s"
    )
    assert not lost, f"{len(lost)} committed events never reached Kafka: {sorted(lost)[:10]}"
    assert not phantom
    assert inversions == 0
    assert outboxes == set(OUTBOXES)
