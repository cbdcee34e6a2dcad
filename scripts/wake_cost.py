"""What a round trip costs a Python process in CPU, back to back and paced (issue #31).

At a steady low rate every event costs the relay a whole wake-up: the NOTIFY, the claim, the
Kafka request, the mark, each a round trip after which the process sleeps. This script measures,
in this process, the CPU time (user + system, from ``getrusage``) per operation of:

- ``sleep``: ``asyncio.sleep(pace)`` alone (the cost of going idle and waking up);
- ``select1``: asyncpg ``fetchval("SELECT 1")``;
- ``kafka``: aiokafka ``send()`` of one small record and its ack (acks=all, idempotent,
  linger 0: the relay's and the bench floor's producer settings);

each back to back (pace 0) and paced (a sleep of ``pace`` seconds between operations, as at
100 ev/s with 10 ms). The difference between paced and back to back is what waking up costs
on this host: caches and branch predictors cold after other processes (PostgreSQL, Kafka's JVM)
ran, plus the scheduler's and, in a VM, the hypervisor's part.

Usage: ``NOTIFY_OUTBOX_DSN=postgresql://... NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS=host:port
.venv/bin/python scripts/wake_cost.py [--paces 0 0.001 0.01] [--count 300] [--topic t]``.
Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import time
from collections.abc import Awaitable, Callable

import asyncpg
import uvloop
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


async def _measure(
    name: str, op: Callable[[int], Awaitable[object]] | None, pace: float, count: int
) -> dict[str, object]:
    user0, sys0 = _cpu()
    began = time.perf_counter()
    for i in range(count):
        if op is not None:
            await op(i)
        if pace:
            await asyncio.sleep(pace)
    user1, sys1 = _cpu()
    wall = time.perf_counter() - began
    return {
        "op": name,
        "pace_s": pace,
        "count": count,
        "cpu_us": round(1e6 * (user1 - user0 + sys1 - sys0) / count, 1),
        "user_us": round(1e6 * (user1 - user0) / count, 1),
        "sys_us": round(1e6 * (sys1 - sys0) / count, 1),
        "wall_us": round(1e6 * wall / count, 1),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paces", type=float, nargs="+", default=[0.0, 0.001, 0.01])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--topic", default="wake-cost")
    args = parser.parse_args()
    bootstrap = os.environ["NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS"]
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        if args.topic not in await admin.list_topics():
            await admin.create_topics([NewTopic(args.topic, 1, 1)])
    finally:
        await admin.close()
    conn = await asyncpg.connect(os.environ["NOTIFY_OUTBOX_DSN"])
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=True,
        linger_ms=0,
    )
    await producer.start()
    try:
        await producer.send_and_wait(args.topic, b"{}", key=b"warm-up")

        async def select1(_: int) -> object:
            return await conn.fetchval("SELECT 1")

        async def kafka(i: int) -> object:
            return await (await producer.send(args.topic, b'{"a":1}', key=f"k{i}".encode()))

        for pace in args.paces:
            for name, op in (("sleep", None), ("select1", select1), ("kafka", kafka)):
                if name == "sleep" and not pace:
                    continue
                print(json.dumps(await _measure(name, op, pace, args.count)), flush=True)
    finally:
        await producer.stop()
        await conn.close()


if __name__ == "__main__":
    uvloop.run(main())
