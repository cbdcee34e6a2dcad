"""A keyed backlog drained by several relays under crashes, and a key spread over two topics.

Scenarios (issue 10, "How it is shown" and item 4):

23 ``kill -9`` while a keyed backlog drains: a backlog of hot keys, cold keys and keyless rows
   is committed with the relays stopped, three relay processes with three workers each drain
   it while writers keep committing to the hot keys, and a random relay is SIGKILLed and
   restarted several times mid-drain. I1-I4 hold, with duplicates only within the rows the
   killed relays can have had in flight.
24 a key whose rows go to two topics, where the first topic fails at ack time (the broker
   rejects the record, the client does not): the key's later row on the other topic waits,
   unpublished, until the failing row is dead-lettered; other keys flow meanwhile.

Replay scenario 23 with ``NOTIFY_OUTBOX_FAULT_SEED=<seed>`` (the seed is printed).
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections.abc import Sequence

import pytest

from tests.conftest import Services
from tests.faults.checker import FIGURES, OutboxChecker
from tests.faults.harness import (
    FaultRelay,
    KafkaTail,
    connect,
    create_topic_with_configs,
    eventually,
    fetchval,
    idle_latency,
    relays,
    task_group,
)

pytestmark = pytest.mark.anyio

SEED_ENV = "NOTIFY_OUTBOX_FAULT_SEED"

# --- 23: kill -9 while a keyed backlog drains ---------------------------------------------------

# 15,000 drained before the last kill once the relay sent record batches (CI, 2026-11-25).
BACKLOG = 40_000
BACKLOG_TX = 500  # rows per backlog transaction: 80 commits, each recorded by the checker
HOT_KEYS = 8  # "key-0".."key-7": also the writers' keys, so they grow while the backlog drains
HOT_SHARE = 0.45  # of the backlog rows: about 2,250 rows per hot key
COLD_KEYS = 3000  # a few rows each
KEYLESS_SHARE = 0.05
KILLS = 4
# Small batches with several workers: many claims, so every kill lands inside some batch.
DRAIN_ENV = {"NOTIFY_OUTBOX_WORKERS": "3", "NOTIFY_OUTBOX_BATCH_SIZE": "50"}


def _seed() -> int:
    given = os.environ.get(SEED_ENV)
    return int(given) if given else random.SystemRandom().randrange(1, 2**31)


def _backlog_keys(rng: random.Random, n: int) -> list[str | None]:
    keys: list[str | None] = []
    for _ in range(n):
        r = rng.random()
        if r < KEYLESS_SHARE:
            keys.append(None)
        elif r < KEYLESS_SHARE + HOT_SHARE:
            keys.append(f"key-{rng.randrange(HOT_KEYS)}")
        else:
            keys.append(f"cold-{rng.randrange(COLD_KEYS)}")
    return keys


async def _backlog_pending(dsn: str, last_id: int) -> int:
    """Backlog rows (ids up to ``last_id``) still pending in the outbox."""
    return int(
        await fetchval(
            dsn,
            "SELECT count(*) FROM outbox WHERE id <= $1 AND published_at IS NULL",
            last_id,
        )
    )


async def _any_up(relays: list[FaultRelay]) -> bool:
    return any(r.matching("relay running") for r in relays)


@pytest.fixture(params=["direct", "pgbouncer-transaction", "pgbouncer-session"])
def relay_route(request: pytest.FixtureRequest, db_dsn: str) -> tuple[str, dict[str, str]]:
    """How the relays reach PostgreSQL: directly, or through PgBouncer (their DSN, and extra
    environment). Through transaction pooling, the one listening connection goes direct."""
    if request.param == "direct":
        return db_dsn, {}
    mode = request.param.removeprefix("pgbouncer-")
    pooled = request.getfixturevalue("poolers").dsn_through(mode, db_dsn)
    return pooled, ({"NOTIFY_OUTBOX_LISTEN_DSN": db_dsn} if mode == "transaction" else {})


async def test_23_kill_9_while_a_keyed_backlog_drains_with_three_relays(
    db_dsn: str, services: Services, topic: str, relay_route: tuple[str, dict[str, str]]
) -> None:
    """40,000 committed rows (hot keys with ~2,250 rows each, 3,000 cold keys, 5% keyless) wait
    when three relays (3 workers, batch 50) start; three writers keep committing to the hot
    keys. At four points of the drain (by backlog events arrived in Kafka) a random relay is
    SIGKILLed and a new one started. Every kill must land while backlog rows are still
    pending; at the end nothing is lost or phantom, every key's events are in commit order,
    and duplicates stay within the killed relays' in-flight bound. Then an event on the idle
    relays arrives within the I5 bound. Run three times: relays connected directly, and
    through PgBouncer in transaction and in session pooling (a killed relay's server
    sessions, and with them its row and key locks, must be let go by the pooler)."""
    seed = _seed()
    rng = random.Random(seed)
    print(f"[23] seed {seed} (replay: {SEED_ENV}={seed})")
    FIGURES.notes.setdefault("23: seeds", []).append(seed)
    checker = await OutboxChecker(
        db_dsn, services.bootstrap, [topic], f"23 kill -9 mid-backlog #{seed}"
    ).setup()
    backlog_ids: set[str] = set()
    async with checker.producer() as p:
        for _ in range(BACKLOG // BACKLOG_TX):
            backlog_ids.update(await p.bulk(_backlog_keys(rng, BACKLOG_TX)))
    last_backlog_id = int(await fetchval(db_dsn, "SELECT max(id) FROM outbox"))
    assert await _backlog_pending(db_dsn, last_backlog_id) == BACKLOG

    load = checker.writers(
        writers=3, keys=HOT_KEYS, keyless_ratio=0.05, rollback_ratio=0.1, pause=0.005, seed=seed
    )
    # Kill points: fractions of the backlog seen in Kafka, one at random in each of KILLS
    # equal slices of 8%-68%, so that the kills are spread over the drain and none comes
    # after it.
    width = 0.6 / KILLS
    points = [0.08 + k * width + rng.uniform(0, width) for k in range(KILLS)]
    spawned: list[FaultRelay] = []
    live: list[FaultRelay] = []

    def spawn() -> FaultRelay:
        dsn, route_env = relay_route
        relay = FaultRelay(
            dsn,
            services.bootstrap,
            env={**DRAIN_ENV, **route_env},
            name=f"relay-{len(spawned) + 1}",
        )
        spawned.append(relay)
        return relay

    def arrived() -> int:
        return len(backlog_ids & tail.first_seen.keys())

    async def reached(n: int) -> bool:
        return arrived() >= n

    kills: list[dict[str, float | int | str]] = []
    async with KafkaTail(services.bootstrap, [topic]) as tail, task_group() as tg:
        try:
            first = [spawn() for _ in range(3)]
            started = time.monotonic()
            tg.start_soon(load.run)
            for relay in first:
                await relay.ready()
                live.append(relay)
            for k, point in enumerate(points):
                target = int(point * BACKLOG)
                await eventually(
                    lambda: reached(target),  # noqa: B023
                    within=90,
                    what=f"{target} backlog events in Kafka before kill {k + 1}",
                    interval=0.02,
                    details=lambda: f"{arrived()} of {BACKLOG} arrived",
                )
                # The victim is a relay that is up (claiming); a replacement still starting
                # is only picked when no other is up yet.
                await eventually(
                    lambda: _any_up(live), within=60, what="a relay is up to be killed"
                )
                up = [r for r in live if r.matching("relay running")]
                victim = up[rng.randrange(len(up))]
                live.remove(victim)
                await victim.kill()
                checker.allow_duplicates(
                    victim.in_flight_bound, f"relay crash: SIGKILL {victim.name} mid-backlog"
                )
                # Ids up to the last backlog id still pending just after the kill: the kill
                # came while the backlog drained (the rows the victim held are among them).
                left = await _backlog_pending(db_dsn, last_backlog_id)
                kills.append({"relay": victim.name, "arrived": arrived(), "backlog_pending": left})
                print(f"[23] kill {k + 1}: SIGKILL {victim.name}; {kills[-1]}")
                # Not waiting for the replacement to be up: the next kill point may come
                # before it is, and a fast drain must not outrun the kills.
                live.append(spawn())
            last_kill = time.monotonic()
            for relay in live:
                await relay.ready()
            drained_at = await tail.wait_for(
                backlog_ids, within=120, what="the whole backlog after the kills"
            )
            await load.halt()
            async with checker.producer() as p:
                idle = await idle_latency(
                    db_dsn, lambda: p.produce("idle"), tail, what=f"after the kills, seed {seed}"
                )
            report = await checker.drain_and_check(within=120)
            for relay in live:
                await relay.stop_ok()
        except BaseException:
            for relay in spawned:
                print(relay.output())
                print(f"full log of {relay.name}: {relay.dump()}")
            print(f"[23] seed {seed}, kills so far {kills}")
            raise
        finally:
            for relay in spawned:
                relay.__exit__(None, None, None)
    drain_s = drained_at - started
    FIGURES.recovery("relay kill mid-backlog (last kill to drained)", drained_at - last_kill)
    FIGURES.notes["23: backlog drain"] = (
        f"{BACKLOG} rows + {report.committed - BACKLOG} live in {drain_s:.1f}s "
        f"({BACKLOG / drain_s:.0f} backlog ev/s) with {KILLS} kills; idle latency {idle:.3f}s"
    )
    print(report.text())
    print(f"[23] seed {seed}; kills {kills}; backlog drained {drain_s:.1f}s after start")
    late = [k for k in kills if int(k["backlog_pending"]) == 0]
    assert not late, (
        f"kills after the backlog had drained: {late}; if the relay now drains this fast, "
        "raise BACKLOG so that the kills land mid-drain"
    )
    assert report.committed > BACKLOG
    assert report.keys > COLD_KEYS // 2, "the backlog's keys are all checked for order"
    report.assert_ok()


# --- 24: a key's rows on two topics, the first failing at ack time ------------------------------

# The broker's per-topic limit; the failing row's payload is above it and far below the
# producer's max_request_size (1 MiB), so aiokafka sends it and only the broker rejects it.
SMALL_TOPIC_BYTES = 2000
BIG_PAYLOAD = json.dumps({"big": "x" * 5000})
TWO_TOPICS_ATTEMPTS = 3


async def _outbox_row(dsn: str, event_id: str) -> tuple[int, bool] | None:
    """(attempts, published) of the row, or None once it left the outbox."""
    async with connect(dsn) as conn:
        row = await conn.fetchrow(
            "SELECT attempts, published_at IS NOT NULL AS published FROM outbox "
            "WHERE event_id = $1",
            uuid.UUID(event_id),
        )
    return None if row is None else (int(row["attempts"]), bool(row["published"]))


async def _failed_once(dsn: str, event_id: str) -> bool:
    state = await _outbox_row(dsn, event_id)
    return state is not None and state[0] >= 1


async def _dead(dsn: str, event_id: str) -> bool:
    n = await fetchval(
        dsn, "SELECT count(*) FROM outbox_dead_letter WHERE event_id = $1", uuid.UUID(event_id)
    )
    return int(n) == 1


def _not_in(tail: KafkaTail, ids: Sequence[str]) -> list[str]:
    return [e for e in ids if e not in tail.first_seen]


async def test_24_key_on_two_topics_waits_while_its_row_fails_at_ack_time(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Key K: r1 to topic T1 (max.message.bytes 2000, r1 ~5 KB: the broker rejects it at
    ack time), then r2 to T2, committed in that order; rows of another key O on T2 around
    them. Both are committed before the relay starts, so one claim can see them together.
    While r1 waits for its retry, r2 is neither in Kafka nor marked published in the outbox,
    and O's rows (earlier and newly committed) arrive. After max_attempts r1 is
    dead-lettered with the broker's error, and only then r2 is published, once."""
    small = f"t-small-{uuid.uuid4().hex[:12]}"
    await create_topic_with_configs(
        services.bootstrap, small, {"max.message.bytes": str(SMALL_TOPIC_BYTES)}
    )
    checker = await OutboxChecker(
        db_dsn, services.bootstrap, [topic, small], "24 key on two topics, ack-time failure"
    ).setup()  # the first topic is the producers' default: T2; only r1 goes to T1
    env = {
        "NOTIFY_OUTBOX_MAX_ATTEMPTS": str(TWO_TOPICS_ATTEMPTS),
        # Retries at >= 0.5 s and >= 1 s after the failures: a window of >= 1.5 s in which
        # r1 is known to be pending, long enough to see other keys arrive meanwhile.
        "NOTIFY_OUTBOX_RETRY_BASE_DELAY": "1",
        "NOTIFY_OUTBOX_RETRY_MAX_DELAY": "4",
        "NOTIFY_OUTBOX_POLL_INTERVAL": "0.2",  # a retry falls due with no notification
        "NOTIFY_OUTBOX_KEEP_PUBLISHED": "3600",  # keep r2 to compare its published_at
    }
    async with checker.producer() as p:
        before = [await p.produce("O") for _ in range(3)]
        r1 = await p.produce("K", topic=small, payload=BIG_PAYLOAD)
        r2 = await p.produce("K")
        after = [await p.produce("O") for _ in range(3)]
    checker.expect_dead([r1])
    async with (
        relays(FaultRelay(db_dsn, services.bootstrap, env=env, name="two-topics")) as (relay,),
        KafkaTail(services.bootstrap, [small, topic]) as tail,
        checker.producer() as p,
    ):
        await relay.ready()
        await eventually(
            lambda: _failed_once(db_dsn, r1),
            within=30,
            what="r1 (over T1's max.message.bytes) failed a first time",
            details=relay.output,
        )
        # r1 is now pending for a retry: other keys flow ...
        await tail.wait_for(before + after, within=30, what="key O's backlog while r1 retries")
        during = [await p.produce("O") for _ in range(3)]
        await tail.wait_for(during, within=30, what="key O's new rows while r1 retries")
        r1_state = await _outbox_row(db_dsn, r1)
        r2_state = await _outbox_row(db_dsn, r2)
        r2_early = r2 in tail.first_seen
        assert r1_state is not None, "r1 left the outbox before key O's rows arrived"
        assert r1_state[0] < TWO_TOPICS_ATTEMPTS, f"r1 retried out meanwhile: {r1_state}"
        # ... but K's later row, on the other topic, waits behind r1.
        overtaken = (
            f"r2 (key K, topic {topic}) overtook r1, which is pending for a retry "
            f"(attempts {r1_state[0]}): r2 in Kafka: {r2_early}; r2 in the outbox as "
            f"(attempts, published): {r2_state} (None: deleted)\n{relay.output()}"
        )
        assert not r2_early, overtaken
        assert r2_state == (0, False), overtaken
        await eventually(
            lambda: _dead(db_dsn, r1),
            within=60,
            what=f"r1 is dead-lettered after {TWO_TOPICS_ATTEMPTS} attempts",
            details=relay.output,
        )
        await tail.wait_for([r2], within=30, what="r2 after r1 was dead-lettered")
        report = await checker.drain_and_check(within=60)
        dead = (await checker.dead_letters())[r1]
        published_at = await fetchval(
            db_dsn, "SELECT published_at FROM outbox WHERE event_id = $1", uuid.UUID(r2)
        )
        await relay.stop_ok()
    print(report.text())
    print(f"[24] r1 dead-lettered: attempts {dead['attempts']}, error {dead['error']!r}")
    # The broker's own rejection (error code 10), not the client's size check.
    assert "MessageSizeTooLarge" in dead["error"], dead
    assert "[Error 10]" in dead["error"], dead
    assert dead["attempts"] == TWO_TOPICS_ATTEMPTS, dead
    assert published_at is not None, "r2 is not marked published"
    assert published_at >= dead["dead_lettered_at"], (
        f"r2 marked published at {published_at}, r1 dead-lettered at {dead['dead_lettered_at']}"
    )
    sent_ms = [r.timestamp_ms for r in report.records if r.event_id == r2]
    assert len(sent_ms) == 1, f"r2 in Kafka {len(sent_ms)} times"
    assert sent_ms[0] >= dead["dead_lettered_at"].timestamp() * 1000 - 1, "r2 was sent early"
    assert report.duplicates == 0
    report.assert_ok()
