"""A consumer process for the inbox's end-to-end fault test (``test_inbox_e2e.py``).

``python -m tests.faults.inbox_consumer`` reads the orders topic in a consumer group through
``notify_outbox.inbox.consume`` and applies each order to its own table, ``consumer_orders``
(deliberately without a unique constraint, so a double apply would show as a count of 2). Every
repeat the inbox absorbs is recorded in ``consumer_repeats`` in the same transaction, so the
figure survives the process being killed.

Environment: ``INBOX_TEST_DSN`` (the consumer's database), ``INBOX_TEST_BOOTSTRAP``,
``INBOX_TEST_TOPIC``, ``INBOX_TEST_GROUP``, ``INBOX_TEST_NAME`` (client id, for logs),
``INBOX_TEST_PATH``: ``each`` (``consume``, a handler per message) or ``batch``
(``consume_batches``, one INSERT for a batch's fresh messages), and optionally
``INBOX_TEST_CRASH_AFTER=N``: SIGKILL itself right after the N-th database commit (of a message
or of a partition batch), before its Kafka offset is committed; the exact window that makes
Kafka redeliver messages whose changes are already committed.

It logs ``partitions assigned: N`` after each rebalance, so the test can tell when the group
has moved on without a frozen member.

The zombie hook: SIGUSR1 arms it. The next partition batch the loop hands to the inbox (fetched,
not applied yet) is logged (``zombie: holding N ... ids: ...``), then the process stops itself
with SIGSTOP, holding that batch. After the test's SIGCONT it applies the batch as it would
have, and logs what the inbox did with it (``zombie: resumed, applied A of the N held messages
...``) and what Kafka said to that batch's offset commit (``zombie: offset commit ...:
refused (CommitFailedError)`` or ``accepted``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener

from notify_outbox.inbox import (
    BatchResult,
    Inbox,
    consume,
    consume_batches,
)

SETUP_SQL = """
CREATE TABLE IF NOT EXISTS consumer_orders (
    event_id   text    NOT NULL,
    order_id   bigint  NOT NULL,
    total      integer NOT NULL,
    applied_by text    NOT NULL
);
CREATE TABLE IF NOT EXISTS consumer_repeats (event_id text NOT NULL, seen_by text NOT NULL);
"""

log = logging.getLogger("inbox_consumer")


class CountingInbox(Inbox):
    """The inbox, plus a record of every repeat it absorbed and an optional crash point."""

    def __init__(self, *, name: str, crash_after: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.name = name
        self.crash_after = crash_after
        self.commits = 0
        self.freeze_armed = False  # set by SIGUSR1: freeze holding the next batch
        self.kafka: ZombieConsumer | None = None

    def arm(self) -> None:
        self.freeze_armed = True
        log.info("zombie: armed, freezing before the next batch is applied")

    def _freeze_holding(self, messages: Sequence[Any]) -> bool:
        """If armed: log the batch about to be applied and SIGSTOP this process, holding it.
        Returns whether it froze (the code after it runs after SIGCONT)."""
        if not self.freeze_armed or not messages:
            return False
        self.freeze_armed = False
        first, last = messages[0], messages[-1]
        log.info(
            "zombie: holding %d messages (partition %d, offsets %d-%d), fetched, not applied; "
            "ids: %s",
            len(messages),
            first.partition,
            first.offset,
            last.offset,
            ",".join(self.event_id(m) for m in messages),
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGSTOP)  # returns after SIGCONT
        log.info("zombie: resumed (SIGCONT), applying the held batch")
        return True

    def _after_held(self, held: Sequence[Any], result: BatchResult) -> None:
        log.info(
            "zombie: resumed, applied %d of the %d held messages (repeats %d)",
            result.applied,
            len(held),
            result.duplicates,
        )
        if self.kafka is not None:
            self.kafka.report_next_commit = True  # the loop commits this batch's offset next

    async def claim_batch(self, conn: asyncpg.Connection, event_ids: Sequence[str]) -> set[str]:
        fresh = await super().claim_batch(conn, event_ids)
        repeats = [e for e in event_ids if e not in fresh]
        if repeats:  # in the batch's transaction: the figure survives a kill
            await conn.execute(
                "INSERT INTO consumer_repeats SELECT unnest($1::text[]), $2", repeats, self.name
            )
        return fresh

    def _committed(self) -> None:
        self.commits += 1
        if self.commits == self.crash_after:
            # Committed in the database, offset not yet committed in Kafka.
            os.kill(os.getpid(), signal.SIGKILL)

    async def apply_each(
        self, db: Any, messages: Sequence[Any], *args: Any, **kwargs: Any
    ) -> BatchResult:
        held = self._freeze_holding(messages)
        result = await super().apply_each(db, messages, *args, **kwargs)
        if held:
            self._after_held(messages, result)
        self._committed()
        return result

    async def apply_batch(
        self, db: Any, messages: Sequence[Any], *args: Any, **kwargs: Any
    ) -> BatchResult:
        held = self._freeze_holding(messages)
        result = await super().apply_batch(db, messages, *args, **kwargs)
        if held:
            self._after_held(messages, result)
        self._committed()
        return result


class ZombieConsumer(AIOKafkaConsumer):  # type: ignore[misc]
    """The Kafka consumer, logging the outcome of the offset commit of a held batch."""

    report_next_commit = False

    async def commit(self, offsets: Any = None) -> None:
        if not self.report_next_commit:
            await super().commit(offsets)
            return
        self.report_next_commit = False
        where = ", ".join(f"partition {tp.partition} offset {o}" for tp, o in offsets.items())
        try:
            await super().commit(offsets)
        except Exception as e:
            log.info(
                "zombie: offset commit of the held batch (%s): refused (%s)",
                where,
                type(e).__name__,
            )
            raise
        log.info("zombie: offset commit of the held batch (%s): accepted", where)


class LoggingListener(ConsumerRebalanceListener):  # type: ignore[misc]
    """The application's own rebalance listener, chained by ``consume(topics=...)`` to the
    inbox's: it logs each assignment for the test to wait on."""

    def on_partitions_revoked(self, revoked: Any) -> None:
        pass

    def on_partitions_assigned(self, assigned: Any) -> None:
        log.info("partitions assigned: %d", len(assigned))


async def run() -> None:
    env = os.environ
    name = env["INBOX_TEST_NAME"]
    pool = await asyncpg.create_pool(env["INBOX_TEST_DSN"], min_size=1, max_size=2)
    consumer = ZombieConsumer(
        bootstrap_servers=env["INBOX_TEST_BOOTSTRAP"],
        group_id=env["INBOX_TEST_GROUP"],
        client_id=name,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        # A killed member leaves the group after this; the broker's minimum is 6 s.
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
        max_poll_records=50,
    )
    # consume subscribes it to the topic, with the inbox's listener chained to this one.
    topics = [env["INBOX_TEST_TOPIC"]]
    listener = LoggingListener()
    inbox = CountingInbox(
        name=name, crash_after=int(env.get("INBOX_TEST_CRASH_AFTER", "0")), consumer="orders"
    )
    inbox.kafka = consumer
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, inbox.arm)

    async def handler(conn: asyncpg.Connection, record: Any) -> None:
        order = json.loads(record.value)
        await conn.execute(
            "INSERT INTO consumer_orders VALUES ($1, $2, $3, $4)",
            inbox.event_id(record),
            order["order_id"],
            order["total"],
            name,
        )

    async def bulk(conn: asyncpg.Connection, records: list[Any]) -> None:
        orders = [json.loads(r.value) for r in records]
        await conn.execute(
            "INSERT INTO consumer_orders SELECT e, o, t, $4 "
            "FROM unnest($1::text[], $2::bigint[], $3::integer[]) AS x(e, o, t)",
            [inbox.event_id(r) for r in records],
            [o["order_id"] for o in orders],
            [o["total"] for o in orders],
            name,
        )

    await consumer.start()
    try:
        log.info("consumer running (%s path)", env["INBOX_TEST_PATH"])
        if env["INBOX_TEST_PATH"] == "batch":
            await consume_batches(
                consumer, pool, bulk, inbox=inbox, topics=topics, listener=listener
            )
        else:
            await consume(consumer, pool, handler, inbox=inbox, topics=topics, listener=listener)
    finally:
        await consumer.stop()
        await pool.close()


def main() -> int:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
