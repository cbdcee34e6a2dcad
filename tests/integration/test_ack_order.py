"""Per-key order when a record fails at the broker (docs/concepts/guarantees.md).

A claim's sends are pipelined: every ``send()`` is queued before any ack is awaited. aiokafka's
idempotent producer numbers a partition's record batches when it sends them and never takes a
number back, so after a batch the broker refused, it sends the partition's next batch with a
sequence gap. A broker that holds state for the producer on that partition refuses it
(OUT_OF_ORDER_SEQUENCE_NUMBER); one that does not, because the refused batch was the
producer's first there, appends it. Here the refused record is a row over the topic's
``max.message.bytes`` (within the producer's ``max_request_size``) and over aiokafka's batch
size, so it travels in a batch of its own between its key's earlier and later rows.

Per key, the consumed sequence (first occurrences) must be the commit order, less a
dead-lettered row; and while the failing row is pending, none of its key's later rows may be in
the topic, or a consumer sees them before it once it is retried.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import anyio
import asyncpg
import pytest
from aiokafka import ConsumerRecord
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from notify_outbox import Relay, enqueue
from tests.conftest import Services
from tests.integration.test_relay import make_settings
from tests.support import consume, create_topics, header, logged

pytestmark = pytest.mark.anyio

# Record batches close at 16,384 bytes (NOTIFY_OUTBOX_KAFKA_BATCH_SIZE, set so for this test),
# unless its first record is larger: that one travels alone.
BATCH_SIZE = 16_384
# The topic's limit: above a full batch of small rows, below the big row.
TOPIC_MAX_MESSAGE_BYTES = BATCH_SIZE + 4_000
# Over the limit and over the batch size (a batch of its own), within max_request_size.
BIG = {"big": "x" * (TOPIC_MAX_MESSAGE_BYTES + 10_000)}
# J's rows: enough to fill a few batches behind the big row's.
J_ROWS_PER_K_ROW = 20
J_PAD = "j" * 500
WAIT = 60.0


async def _topic_now(bootstrap: str, topic: str) -> list[ConsumerRecord[bytes, bytes]]:
    """Every record the topic holds now (to its end offsets), in offset order."""
    _, total = await consume(bootstrap, topic, expect=0)
    records, _ = await consume(bootstrap, topic, expect=total)
    return records


def _first_occurrences(records: Sequence[ConsumerRecord[bytes, bytes]]) -> dict[str, list[str]]:
    """Per key, the event ids in offset order with repeats removed (what a deduplicating
    consumer applies)."""
    seen: set[str] = set()
    out: dict[str, list[str]] = defaultdict(list)
    for r in records:
        event_id = header(r, "outbox-event-id")
        assert event_id is not None
        assert r.key is not None
        if event_id not in seen:
            seen.add(event_id)
            out[r.key.decode()].append(event_id)
    return dict(out)


async def _raise_topic_limit(bootstrap: str, topic: str, limit: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        with anyio.fail_after(WAIT):
            await admin.start()
            await admin.alter_configs(
                [
                    ConfigResource(
                        ConfigResourceType.TOPIC, topic, configs={"max.message.bytes": str(limit)}
                    )
                ]
            )
    finally:
        await admin.close()


@pytest.mark.parametrize("resolution", ["delivered", "dead-lettered"])
@pytest.mark.parametrize(
    "acked_before", [False, True], ids=["first-on-partition", "after-an-acked-row"]
)
async def test_a_keys_later_rows_never_overtake_its_row_refused_by_the_broker(
    db_dsn: str, services: Services, acked_before: bool, resolution: str
) -> None:
    """Key K in commit order: (a small row, when ``acked_before``), the big row, then three
    small rows, each followed by rows of another key J that fill a few batches; all in one
    claim on a one-partition topic. ``first-on-partition``: the big row's batch is the
    relay's first there; ``after-an-acked-row``: the broker took one of its batches before.
    ``delivered``: the topic's limit is raised while the big row waits, and its retry goes
    through; ``dead-lettered``: it fails its last attempt."""
    topic = f"t-{uuid.uuid4().hex[:12]}"
    await create_topics(
        services.bootstrap,
        [topic],
        partitions=1,
        configs={"max.message.bytes": str(TOPIC_MAX_MESSAGE_BYTES)},
    )
    dead = resolution == "dead-lettered"
    committed: dict[str, list[str]] = defaultdict(list)  # per key, event ids in commit order
    conn = await asyncpg.connect(db_dsn)
    try:
        # One transaction, committed before the relay starts: its first claim holds them all.
        async with conn.transaction():

            async def add(key: str, payload: dict[str, Any]) -> str:
                event_id = str(await enqueue(conn, topic=topic, key=key, payload=payload))
                committed[key].append(event_id)
                return event_id

            if acked_before:
                await add("K", {"n": 0})
            big = await add("K", BIG)
            for n in range(1, 4):
                await add("K", {"n": n})
                for j in range(J_ROWS_PER_K_ROW):
                    await add("J", {"n": n, "j": j, "pad": J_PAD})
        before = committed["K"][: committed["K"].index(big)]
        settings = make_settings(
            db_dsn,
            services,
            workers=1,  # one claim at a time: the big row's batch is the one described
            kafka_batch_size=BATCH_SIZE,
            poll_interval=0.2,  # a retry falls due with no notification
            # Dead-lettered: one retry, held back until the test makes it due. Delivered:
            # retried quickly until the topic takes it.
            max_attempts=2 if dead else 1000,
            retry_base_delay=3600.0 if dead else 0.05,
            retry_max_delay=3600.0 if dead else 0.2,
        )
        with logged("notify_outbox.publisher", "replacing the producer") as replaced:
            async with Relay(settings) as relay:
                with anyio.fail_after(WAIT):
                    await relay.events.wait_for("retried")
                    # Other keys do not wait: J's rows (and K's before the big row) go out.
                    await relay.events.wait_for("published", len(before) + len(committed["J"]))
                # The big row is pending now (the broker refuses it at every attempt so far).
                state = await conn.fetchrow(
                    "SELECT attempts, last_error FROM outbox WHERE event_id = $1::uuid", big
                )
                assert state is not None
                assert state["attempts"] >= 1, state
                assert "MessageSizeTooLarge" in state["last_error"], state
                pending = _first_occurrences(await _topic_now(services.bootstrap, topic))
                assert pending.get("K", []) == before, (
                    f"K's later rows reached the topic while its row {big} waits for a retry "
                    f"(first occurrences {pending.get('K')}, commit order {committed['K']})"
                )
                assert pending.get("J") == committed["J"]

                if dead:
                    await conn.execute(
                        "UPDATE outbox SET next_attempt_at = now() WHERE event_id = $1::uuid", big
                    )
                    expected_k = [e for e in committed["K"] if e != big]
                else:
                    await _raise_topic_limit(services.bootstrap, topic, 1_000_000)
                    expected_k = committed["K"]
                with anyio.fail_after(WAIT):
                    await relay.events.wait_for("published", len(expected_k) + len(committed["J"]))
                assert await conn.fetchval("SELECT count(*) FROM outbox") == 0
                # A refused record is the row's failure, not a Kafka outage.
                assert relay.events.counts["kafka_unavailable"] == 0, "taken for a Kafka outage"
                dead_letters = await conn.fetch("SELECT event_id, error FROM outbox_dead_letter")
        # The refused batch's partition went on without it, with the same producer (a new
        # one paused every topic at each attempt).
        assert not replaced.is_set()
    finally:
        await conn.close()
    final = _first_occurrences(await _topic_now(services.bootstrap, topic))
    assert final == {"K": expected_k, "J": committed["J"]}
    if dead:
        assert [str(r["event_id"]) for r in dead_letters] == [big]
        # The broker's own refusal (error code 10), not the client's size check.
        assert "[Error 10]" in dead_letters[0]["error"], dead_letters[0]["error"]
    else:
        assert dead_letters == []


async def test_batches_over_the_topics_limit_are_split_and_no_row_fails(
    db_dsn: str, services: Services
) -> None:
    """A topic whose max.message.bytes is below the relay's batch size refuses whole batches
    of small rows. That is no row's failure: the rows go again in smaller batches, every one
    is delivered in its key's order, none counts an attempt or is dead-lettered."""
    topic = f"t-{uuid.uuid4().hex[:12]}"
    await create_topics(
        services.bootstrap, [topic], partitions=1, configs={"max.message.bytes": "20000"}
    )
    committed: dict[str, list[str]] = defaultdict(list)
    conn = await asyncpg.connect(db_dsn)
    try:
        async with conn.transaction():  # ~300 KB in one claim: one batch of 256 KiB and more
            for n in range(300):
                key = f"k{n % 10}"
                event_id = await enqueue(
                    conn, topic=topic, key=key, payload={"n": n, "pad": J_PAD * 2}
                )
                committed[key].append(str(event_id))
        settings = make_settings(db_dsn, services, workers=1, max_attempts=1)
        with (
            logged("notify_outbox.publisher", "refused a batch of") as split,
            logged("notify_outbox.publisher", "replacing the producer") as replaced,
        ):
            async with Relay(settings) as relay:
                with anyio.fail_after(WAIT):
                    await relay.events.wait_for("published", 300)
            assert split.is_set()
            assert not replaced.is_set()
        assert relay.events.counts["retried"] == 0
        assert relay.events.counts["dead_lettered"] == 0
        assert await conn.fetchval("SELECT count(*) FROM outbox_dead_letter") == 0
    finally:
        await conn.close()
    assert _first_occurrences(await _topic_now(services.bootstrap, topic)) == committed


async def test_refused_records_among_four_workers_keep_every_keys_order(
    db_dsn: str, services: Services
) -> None:
    """Four workers share one producer and one partition while rows come in: each refused
    batch drops whatever the other claims had queued behind it on the partition. Every row
    but the big ones is delivered, each key's first occurrences in commit order, the big
    rows are dead-lettered, and the producer is never replaced."""
    topic = f"t-{uuid.uuid4().hex[:12]}"
    await create_topics(
        services.bootstrap, [topic], partitions=1, configs={"max.message.bytes": "4000"}
    )
    committed: dict[str, list[str]] = defaultdict(list)
    big_ids: list[str] = []
    settings = make_settings(
        db_dsn,
        services,
        workers=4,
        batch_size=20,
        max_attempts=2,
        retry_base_delay=0.05,
        retry_max_delay=0.1,
        poll_interval=0.2,
    )
    conn = await asyncpg.connect(db_dsn)
    try:
        with logged("notify_outbox.publisher", "replacing the producer") as replaced:
            async with Relay(settings) as relay:
                for n in range(400):
                    key = f"k{n % 20}"
                    big = n % 37 == 5
                    payload = {"n": n, "pad": "x" * (8_000 if big else 200)}
                    event_id = str(await enqueue(conn, topic=topic, key=key, payload=payload))
                    if big:
                        big_ids.append(event_id)
                    else:
                        committed[key].append(event_id)
                with anyio.fail_after(WAIT):
                    await relay.events.wait_for("dead_lettered", len(big_ids))
                    await relay.events.wait_for("published", 400 - len(big_ids))
            dead = [
                str(r["event_id"])
                for r in await conn.fetch("SELECT event_id FROM outbox_dead_letter")
            ]
        assert not replaced.is_set()
    finally:
        await conn.close()
    assert sorted(dead) == sorted(big_ids)
    assert _first_occurrences(await _topic_now(services.bootstrap, topic)) == committed
