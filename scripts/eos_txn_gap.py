"""What one Kafka transaction costs right after the previous one (docs/benchmarks.md, issue #35).

One aiokafka transactional producer runs ``--transactions`` transactions of one record each
(begin, send, wait for the ack, commit), pausing ``--gap`` seconds between them, and prints the
p50 / p90 / p99 / max of each transaction's time and how often the coordinator refused its
first partition with CONCURRENT_TRANSACTIONS (it does while it still writes the previous
commit's markers; aiokafka then waits ``--backoff`` seconds, its BACKOFF_OVERRIDE, 0.02 by
default, before it asks again)::

    NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:9092 \\
        python scripts/eos_txn_gap.py --gap 0 --backoff 0.02 --backoff 0.002
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import Counter
from typing import Any

import aiokafka.producer.sender as sender
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

_refusals: Counter[bool] = Counter()
_handle_response = sender.AddPartitionsToTxnHandler.handle_response


def _counting(self: Any, response: Any) -> Any:
    backoff = _handle_response(self, response)
    _refusals[backoff is not None] += 1
    return backoff


sender.AddPartitionsToTxnHandler.handle_response = _counting


async def run(bootstrap: str, transactions: int, gap: float, backoff: float) -> None:
    sender.BACKOFF_OVERRIDE = backoff
    _refusals.clear()
    topic = f"txn-gap-{os.getpid()}-{time.monotonic_ns()}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 4, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        transactional_id=topic,
        enable_idempotence=True,
        acks="all",
        linger_ms=0,
    )
    await producer.start()
    took: list[float] = []
    try:
        for i in range(transactions):
            started = time.perf_counter()
            await producer.begin_transaction()
            await (await producer.send(topic, b"x", key=str(i % 4).encode()))
            await producer.commit_transaction()
            took.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(gap)
    finally:
        await producer.stop()
    took.sort()

    def at(q: float) -> float:
        return took[min(len(took) - 1, int(len(took) * q))]

    print(
        f"gap {gap * 1000:g} ms, backoff {backoff * 1000:g} ms: "
        f"p50 {at(0.5):.2f} p90 {at(0.9):.2f} p99 {at(0.99):.2f} max {took[-1]:.2f} ms; "
        f"first partition refused {_refusals[True]} times in {transactions} transactions"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transactions", type=int, default=300)
    p.add_argument("--gap", type=float, default=0.001, help="seconds between transactions")
    p.add_argument(
        "--backoff", type=float, action="append", help="aiokafka's wait (s); repeat to compare"
    )
    args = p.parse_args()
    bootstrap = os.environ["NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS"]
    for backoff in args.backoff or [0.02]:
        asyncio.run(run(bootstrap, args.transactions, args.gap, backoff))


if __name__ == "__main__":
    main()
