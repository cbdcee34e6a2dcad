"""The baseline: the plain polling outbox publisher of the outbox literature, in one process
(``python -m bench _poller --interval 0.1``).

Every ``interval`` seconds: a transaction claims up to ``batch`` rows (``ORDER BY id LIMIT n FOR
UPDATE SKIP LOCKED``), sends them with an idempotent aiokafka producer (acks=all), deletes them
(``--mark delete``) or sets ``published_at`` (``--mark update``) and commits; a full claim claims
again at once. No LISTEN, no per-key logic, and no failure handling, as in the literature: a
batch Kafka refuses rolls back and the same head is claimed again after ``interval``. Logs
``poller running`` once connected; on SIGTERM finishes its batch (5 s at most) and exits 0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

import asyncpg
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

log = logging.getLogger("bench.poller")

CLAIM = """
SELECT id, event_id, topic, key, payload::text AS payload
FROM outbox
WHERE published_at IS NULL
ORDER BY id
LIMIT $1
FOR UPDATE SKIP LOCKED
"""
DELETE = "DELETE FROM outbox WHERE id = ANY($1::bigint[])"
UPDATE = "UPDATE outbox SET published_at = now() WHERE id = ANY($1::bigint[])"
MARKS = {"delete": DELETE, "update": UPDATE}
_SEND_TIMEOUT = 15.0
_CONNECT_TIMEOUT = 15.0
_STOP_GRACE = 5.0  # on SIGTERM, how long a batch in flight may take before it is given up


async def _poll_once(
    conn: asyncpg.Connection, producer: AIOKafkaProducer, batch: int, mark: str
) -> int:
    async with conn.transaction():
        rows = await conn.fetch(CLAIM, batch)
        if not rows:
            return 0
        futures = []
        for r in rows:
            futures.append(
                await producer.send(
                    r["topic"],
                    value=r["payload"].encode() if r["payload"] is not None else None,
                    key=r["key"].encode() if r["key"] is not None else None,
                    headers=[("outbox-event-id", str(r["event_id"]).encode())],
                )
            )
        async with asyncio.timeout(_SEND_TIMEOUT):
            await asyncio.gather(*futures)
        await conn.execute(MARKS[mark], [r["id"] for r in rows])
    return len(rows)


async def _unless_stopped(poll: asyncio.Task[int], stop: asyncio.Event) -> int:
    """The rows ``poll`` published; when ``stop`` is set first, it gets ``_STOP_GRACE``
    seconds more, then it is cancelled (its transaction rolls back) and counts as 0."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({poll, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if not poll.done():
        await asyncio.wait({poll}, timeout=_STOP_GRACE)
    if not poll.done():
        poll.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poll
        return 0
    return poll.result()


async def run(interval: float, batch: int, mark: str = "delete") -> None:
    """Poll until SIGTERM/SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    conn = await asyncpg.connect(
        os.environ["NOTIFY_OUTBOX_DSN"],
        timeout=_CONNECT_TIMEOUT,
        server_settings={"application_name": "bench-poller"},
    )
    producer = AIOKafkaProducer(
        bootstrap_servers=os.environ["NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS"].split(","),
        acks="all",
        enable_idempotence=True,
        client_id="bench-poller",
    )
    try:
        async with asyncio.timeout(_CONNECT_TIMEOUT):
            await producer.start()
        log.info("poller running: interval %.3fs, batch %d, mark %s", interval, batch, mark)
        while not stop.is_set():
            try:
                n = await _unless_stopped(
                    asyncio.create_task(_poll_once(conn, producer, batch, mark)), stop
                )
            except (KafkaError, TimeoutError) as e:
                log.warning(
                    "batch failed, rolled back (%s); claiming again in %.3fs",
                    f"{type(e).__name__}: {e}".rstrip(": "),
                    interval,
                )
                n = 0
            if n < batch:
                try:
                    async with asyncio.timeout(interval):
                        await stop.wait()
                except TimeoutError:
                    pass
    finally:
        try:
            async with asyncio.timeout(_SEND_TIMEOUT):
                await producer.stop()
        finally:
            await conn.close(timeout=5)


def main(argv: list[str]) -> int:
    """Entry point of ``python -m bench _poller [--interval S] [--batch N] [--mark M]``."""
    p = argparse.ArgumentParser(prog="python -m bench _poller")
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--mark", choices=sorted(MARKS), default="delete")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    from bench.procs import run_async

    run_async(run(args.interval, args.batch, args.mark))
    return 0
