"""``python -m examples.orders [--orders 10] [--keep]``: the orders example, end to end.

1. Starts PostgreSQL and Kafka locally (``devstack``, no Docker), or uses
   ``NOTIFY_OUTBOX_DSN`` and ``NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS`` when both are set.
2. Creates two databases on that server: the order service's (``shop``) and the billing
   consumer's (``billing``), and migrates them with the CLI: ``notify-outbox migrate`` (the
   outbox) and ``notify-outbox migrate --inbox`` (the inbox).
3. Starts the relay (``python -m notify_outbox run``) and the billing consumer.
4. Places orders (``service.place_order``: order + event in one transaction) and waits until
   billing has applied each one.
5. Replays the whole topic to billing, as after an offset reset or a redelivery storm: the
   inbox skips every repeat.
6. Prints what billing applied and skipped, and checks there is exactly one invoice per order
   (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from devstack import Stack, StackError
from devstack.relayproc import RelayError, RelayProcess, create_topics, relay_env
from examples.orders import consumer, service

ROOT = Path(__file__).resolve().parents[2]
CUSTOMERS = ["ada", "grace", "edsger", "barbara", "donald"]
WAIT = 60.0


class ExampleError(Exception):
    """A step failed; the message says which."""


def say(text: str) -> None:
    print(text, flush=True)


def with_database(dsn: str, name: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{name}"))


def cli(dsn: str, *args: str) -> None:
    """Run ``notify-outbox ARGS`` against ``dsn`` and show what it said."""
    result = subprocess.run(
        [sys.executable, "-m", "notify_outbox", *args],
        cwd=ROOT,
        env=relay_env(dsn),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise ExampleError(f"notify-outbox {' '.join(args)}: {result.stderr.strip()}")
    say(f"  $ notify-outbox {' '.join(args)}\n    {result.stdout.strip()}")


async def create_databases(admin_dsn: str, names: Sequence[str]) -> None:
    conn = await asyncpg.connect(admin_dsn)
    try:
        for name in names:
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


async def drop_databases(admin_dsn: str, names: Sequence[str]) -> None:
    conn = await asyncpg.connect(admin_dsn)
    try:
        for name in names:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def create_topic(bootstrap: str, topic: str) -> None:
    await create_topics(bootstrap, [topic], partitions=3)


async def wait_for(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not done():
        if time.monotonic() > deadline:
            raise ExampleError(f"timed out after {WAIT:.0f}s waiting until {what}")
        await asyncio.sleep(0.05)


async def scenario(shop_dsn: str, billing_dsn: str, bootstrap: str, orders: int) -> list[str]:
    """Steps 4-6; returns the failures."""
    topic = f"orders-{uuid.uuid4().hex[:6]}"
    await create_topic(bootstrap, topic)
    inbox = consumer.inbox
    shop = await asyncpg.connect(shop_dsn)
    billing = await asyncpg.create_pool(billing_dsn, min_size=1, max_size=2)
    try:
        await shop.execute(service.SCHEMA)
        async with billing.acquire() as conn:
            await conn.execute(consumer.SCHEMA)
        # Billing's first consumer group, running as the orders come in.
        group = f"billing-{uuid.uuid4().hex[:6]}"
        task = asyncio.create_task(consumer.run(bootstrap, billing, topic=topic, group=group))
        say(f"\nplacing {orders} orders (each: order row + OrderPlaced event, one transaction)")
        for i in range(orders):
            customer = CUSTOMERS[i % len(CUSTOMERS)]
            order_id = await service.place_order(
                shop, customer=customer, total_cents=1000 + 250 * i, topic=topic
            )
            say(f"  order {order_id:>3} for {customer}")
        await wait_for(
            f"billing applied {orders} orders",
            lambda: inbox.counts["applied"] >= orders or task.done(),
        )
        if task.done():
            task.result()
        say(
            f"billing applied {inbox.counts['applied']} orders, "
            f"skipped {inbox.counts['duplicate']} repeats"
        )
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

        say("\nreplaying the whole topic to billing (a new consumer group reads it from the")
        say("beginning, as after an offset reset, or a relay that re-sent after a crash)")
        before = dict(inbox.counts)
        replay = f"billing-replay-{uuid.uuid4().hex[:6]}"
        task = asyncio.create_task(consumer.run(bootstrap, billing, topic=topic, group=replay))
        await wait_for(
            f"billing saw all {orders} orders again",
            lambda: inbox.counts["duplicate"] - before.get("duplicate", 0) >= orders or task.done(),
        )
        if task.done():
            task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        applied = inbox.counts["applied"] - before.get("applied", 0)
        skipped = inbox.counts["duplicate"] - before.get("duplicate", 0)
        say(f"billing applied {applied} orders, skipped {skipped} repeats")

        async with billing.acquire() as conn:
            rows = await conn.fetch(
                "SELECT order_id, customer, amount_cents, count(*) OVER (PARTITION BY order_id) "
                "AS copies FROM invoices ORDER BY order_id"
            )
            recorded = await conn.fetchval("SELECT count(*) FROM inbox")
        say(f"\nbilling's invoices ({len(rows)} rows; {recorded} event ids in its inbox table):")
        for r in rows[:10]:
            say(f"  order {r['order_id']:>3}  {r['customer']:<8} {r['amount_cents'] / 100:>7.2f}")
        if len(rows) > 10:
            say(f"  ... and {len(rows) - 10} more")
        failures = []
        if len(rows) != orders:
            failures.append(f"{len(rows)} invoices for {orders} orders")
        doubles = sorted({r["order_id"] for r in rows if r["copies"] > 1})
        if doubles:
            failures.append(f"orders invoiced more than once: {doubles}")
        if applied != 0 or skipped < orders:
            failures.append(f"the replay applied {applied} and skipped {skipped}")
        return failures
    finally:
        await shop.close()
        await billing.close()


def run(args: argparse.Namespace) -> int:
    env_dsn = os.environ.get("NOTIFY_OUTBOX_DSN")
    env_bootstrap = os.environ.get("NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS")
    stack: Stack | None = None
    base: Path | None = None
    relay: RelayProcess | None = None
    databases: list[str] = []
    admin_dsn = ""
    failures: list[str] = []
    try:
        if env_dsn and env_bootstrap:
            admin_dsn, bootstrap = env_dsn, env_bootstrap
            say("using NOTIFY_OUTBOX_DSN and NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS")
        else:
            base = Path(tempfile.mkdtemp(prefix="notify-outbox-example-"))
            base.chmod(0o711)  # PostgreSQL may run as another user (as root: "postgres")
            say(f"starting PostgreSQL and Kafka in {base} ...")
            stack = Stack(base, durable=False)
            stack.start()
            admin_dsn, bootstrap = stack.postgres.dsn, stack.kafka.bootstrap_servers
        suffix = uuid.uuid4().hex[:6]
        databases = [f"shop_{suffix}", f"billing_{suffix}"]
        asyncio.run(create_databases(admin_dsn, databases))
        shop_dsn, billing_dsn = (with_database(admin_dsn, d) for d in databases)
        say(f"databases: {databases[0]} (order service), {databases[1]} (billing consumer)")
        cli(shop_dsn, "migrate")
        cli(billing_dsn, "migrate", "--inbox")
        relay = RelayProcess(shop_dsn, bootstrap)
        relay.wait_ready(60)
        say("relay running")
        failures = asyncio.run(scenario(shop_dsn, billing_dsn, bootstrap, args.orders))
        code = relay.stop(60)
        if code != 0:
            failures.append(f"the relay exited with code {code}")
    except (ExampleError, RelayError, StackError, OSError, asyncpg.PostgresError) as e:
        failures.append(f"{type(e).__name__}: {e}")
    finally:
        if relay is not None:
            relay.close()
        if stack is None and databases and admin_dsn and not args.keep:
            try:
                asyncio.run(drop_databases(admin_dsn, databases))
            except (OSError, asyncpg.PostgresError) as e:
                failures.append(f"could not drop the example's databases {databases}: {e}")
        if stack is not None and not args.keep:
            stack.stop()
            if base is not None:
                shutil.rmtree(base, ignore_errors=True)
        elif stack is not None:
            say(f"the stack keeps running in {base}: {stack.postgres.dsn}")
    for failure in failures:
        print(f"example: FAILED: {failure}", file=sys.stderr)
    if not failures:
        say("\nexample: OK (one invoice per order, every repeat skipped)")
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.orders", description=__doc__)
    parser.add_argument("--orders", type=int, default=10, help="orders to place (default 10)")
    parser.add_argument("--keep", action="store_true", help="keep the stack and databases")
    args = parser.parse_args(argv)
    if args.orders < 1:
        parser.error("--orders must be at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
