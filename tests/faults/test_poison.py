"""Rows that cannot be published, and many relays at once.

Scenarios (reliability.md): 14 poison rows (oversized, missing topic, malformed headers) and the
policy for a key's later rows; 15 several relay processes with several workers each.
"""

from __future__ import annotations

import json
import uuid

import anyio
import pytest

from devstack._common import free_ports
from tests.conftest import Services
from tests.faults.checker import OutboxChecker
from tests.faults.harness import FaultRelay, KafkaTail, eventually, fetchval, relays, task_group
from tests.support import metric

pytestmark = pytest.mark.anyio


async def test_14_poison_rows_are_retried_then_dead_lettered_while_other_keys_flow(
    db_dsn: str, services: Services, topic: str
) -> None:
    """docs/concepts/guarantees.md, "Failures": a failing row is retried with backoff and
    dead-lettered with its reason after max_attempts; a row that can never be sent as stored
    is dead-lettered at once. While a row is retried, later rows of its key wait behind it and
    other keys flow; once it is dead-lettered, the key's later rows go on, in order."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "14 poison rows").setup()
    max_attempts = 4
    env = {
        "NOTIFY_OUTBOX_MAX_ATTEMPTS": str(max_attempts),
        "NOTIFY_OUTBOX_RETRY_BASE_DELAY": "1",  # retries at >= 0.5, 1 and 2 s: >= 3.5 s total
        "NOTIFY_OUTBOX_RETRY_MAX_DELAY": "4",
        "NOTIFY_OUTBOX_POLL_INTERVAL": "0.2",  # a retry falls due with no notification
        "NOTIFY_OUTBOX_KAFKA_MAX_REQUEST_SIZE": "10000",
    }
    missing_topic = f"no-such-topic-{uuid.uuid4().hex[:8]}"
    poison = {
        "p-big": {"payload": json.dumps({"big": "x" * 20_000})},  # over max_request_size
        "p-missing": {"topic": missing_topic},
        "p-headers": {"headers": json.dumps({"n": 1})},  # a header value that is no string
        "p-reserved": {"headers": json.dumps({"outbox-event-id": "forged"})},
    }
    retried = ("p-big", "p-missing")
    async with (
        relays(FaultRelay(db_dsn, services.bootstrap, env=env)) as (relay,),
        KafkaTail(services.bootstrap, [topic]) as tail,
        checker.producer() as p,
    ):
        await relay.ready()
        poison_ids = {
            key: await p.produce(
                key, topic=c.get("topic"), payload=c.get("payload"), headers=c.get("headers")
            )
            for key, c in poison.items()
        }
        later = {key: [await p.produce(key) for _ in range(3)] for key in poison}
        checker.expect_dead(poison_ids.values())
        # The malformed rows go at once; the others fail and wait for their retry.
        await eventually(
            lambda: _dead_count(db_dsn, 2),
            within=30,
            what="the malformed rows are dead-lettered at once",
        )
        await eventually(
            lambda: _all_retried(db_dsn, [poison_ids[k] for k in retried]),
            within=30,
            what="the failing rows have failed a first time",
        )
        others = [await p.produce(f"key-{i % 20}") for i in range(200)]
        await tail.wait_for(others, within=30, what="other keys while poison rows retry")
        # Other keys all arrived while the failing rows are still being retried ...
        for key in retried:
            attempts = await fetchval(
                db_dsn,
                "SELECT attempts FROM outbox WHERE event_id = $1 AND published_at IS NULL",
                uuid.UUID(poison_ids[key]),
            )
            assert attempts is not None, f"{key} left the outbox before the other keys arrived"
            assert 1 <= attempts < max_attempts
            # ... and their keys' later rows wait behind them.
            early = [e for e in later[key] if e in tail.first_seen]
            assert not early, f"{len(early)} later rows of {key} overtook its failing row"
        await eventually(
            lambda: _dead_count(db_dsn, len(poison)),
            within=60,
            what="the failing rows are dead-lettered after max_attempts",
        )
        report = await checker.drain_and_check(within=60)
        dead = await checker.dead_letters()
        await relay.stop_ok()
    print(report.text())
    by_key = {r["key"]: r for r in dead.values()}
    assert set(by_key) == set(poison)
    assert "MessageSizeTooLarge" in by_key["p-big"]["error"]
    assert "does not exist" in by_key["p-missing"]["error"]
    assert "must have a string value" in by_key["p-headers"]["error"]
    assert "reserved" in by_key["p-reserved"]["error"]
    for key in retried:
        assert by_key[key]["attempts"] == max_attempts, by_key[key]
    for key in ("p-headers", "p-reserved"):
        assert by_key[key]["attempts"] == 1, by_key[key]
    # The later rows of each poisoned key went out only after its dead-lettering.
    sent_ms = {r.event_id: r.timestamp_ms for r in report.records}
    for key, ids in later.items():
        dead_at = by_key[key]["dead_lettered_at"].timestamp() * 1000
        assert all(sent_ms[e] >= dead_at - 1 for e in ids), f"{key}: a later row went early"
    report.assert_ok()


async def _dead_count(dsn: str, n: int) -> bool:
    return int(await fetchval(dsn, "SELECT count(*) FROM outbox_dead_letter")) >= n


async def _all_retried(dsn: str, event_ids: list[str]) -> bool:
    n = await fetchval(
        dsn,
        "SELECT count(*) FROM outbox WHERE event_id = ANY($1::uuid[]) AND attempts >= 1",
        event_ids,
    )
    return int(n) == len(event_ids)


async def test_15_three_relays_with_three_workers_keep_per_key_order(
    db_dsn: str, services: Services, topic: str
) -> None:
    """Three relay processes with three workers each drain live traffic from six writers over
    30 keys (some transactions rolled back, some keyless events): every key's events arrive in
    commit order, each exactly once."""
    checker = await OutboxChecker(db_dsn, services.bootstrap, [topic], "15 three relays").setup()
    env = {"NOTIFY_OUTBOX_WORKERS": "3", "NOTIFY_OUTBOX_BATCH_SIZE": "20"}
    load = checker.writers(writers=6, keys=30, pause=0.002, keyless_ratio=0.05, max_events=400)
    ports = free_ports(3)
    procs = [
        FaultRelay(
            db_dsn,
            services.bootstrap,
            env={**env, "NOTIFY_OUTBOX_HTTP_PORT": str(port)},
            name=f"relay-{i}",
        )
        for i, port in enumerate(ports)
    ]
    async with relays(*procs):
        for r in procs:
            await r.ready()
        async with task_group() as tg:
            tg.start_soon(load.run)
        report = await checker.drain_and_check(within=120)
        # What each relay published, by its own count: the scenario is three relays at work.
        published = [
            await anyio.to_thread.run_sync(
                lambda: metric(port, "notify_outbox_published_total")  # noqa: B023
            )
            for port in ports
        ]
        for r in procs:
            await r.stop_ok()
    print(report.text())
    print(f"published by each relay: {published}")
    assert sum(published) == report.expected_live, published
    assert sum(1 for n in published if n > 0) >= 2, f"one relay did all the work: {published}"
    assert report.committed > 1800
    assert report.duplicates == 0
    report.assert_ok()
