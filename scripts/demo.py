"""notify-outbox end to end: plain SQL in, Kafka out, latency and per-key order checked.

    .venv/bin/python scripts/demo.py [--events 200] [--rate 50] [--keep]

1. Starts PostgreSQL and Kafka (devstack, no Docker; or uses NOTIFY_OUTBOX_DSN and
   NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS when both are set), migrates, creates topic ``orders``.
2. Starts the relay: ``python -m notify_outbox run``.
3. Starts a producer process that knows nothing of notify-outbox: BEGIN, one literal INSERT,
   COMMIT per event, at a fixed rate, keys order-1 .. order-20 in turn.
4. Consumes ``orders`` here: latency is the producer's clock read right before its INSERT to
   this consumer's receipt (one host, one clock); each key must stay on one partition with its
   sequence numbers rising. Exit 0 if all arrived in order and the relay exited 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from asyncpg import PostgresError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from devstack import Stack, StackError  # noqa: E402  (needs ROOT on sys.path)
from devstack.relayproc import RelayError, RelayProcess, cli_argv, create_topics, relay_env  # noqa: E402

TOPIC, KEYS, SHOWN = "orders", 20, 5
INSERT = "INSERT INTO outbox (topic, key, payload) VALUES ('orders', $1, $2::jsonb)"
ENV = ("NOTIFY_OUTBOX_DSN", "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS")


async def produce(dsn: str, events: int, rate: float, run: str) -> None:
    """The producer process: asyncpg and one plain SQL statement, nothing of notify_outbox."""
    conn = await asyncpg.connect(dsn, timeout=30)
    try:
        start = time.monotonic()
        for n in range(events):
            await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))  # fixed schedule
            await conn.execute("BEGIN")
            body = {"run": run, "n": n, "seq": n // KEYS, "sent_ns": time.time_ns()}
            await conn.execute(INSERT, f"order-{n % KEYS + 1}", json.dumps(body))
            await conn.execute("COMMIT")
    finally:
        await conn.close()


Event = tuple[str, int, int, float]  # key, seq, partition, latency in ms


async def consume(dsn: str, bootstrap: str, events: int, rate: float) -> tuple[list[Event], int]:
    """Run the producer process and read its events in arrival order; returns them and the
    producer's exit code. Events of earlier runs (reused services) are skipped by run id."""
    run = uuid.uuid4().hex[:12]
    consumer = AIOKafkaConsumer(TOPIC, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    argv = [sys.executable, __file__, "_produce", str(events), str(rate), run]
    producer = await asyncio.create_subprocess_exec(*argv, env=relay_env(dsn))
    print(f"producer: {events} events at {rate:g}/s, one transaction each", flush=True)
    got: dict[int, Event] = {}  # by event number: a redelivery is not a new event
    deadline = time.monotonic() + events / rate + 60
    try:
        while len(got) < events and time.monotonic() < deadline and not producer.returncode:
            batch = await consumer.getmany(timeout_ms=200)
            now = time.time_ns()
            for record in (r for records in batch.values() for r in records):
                body = json.loads(record.value or b"null")
                if not isinstance(body, dict) or body.get("run") != run or body["n"] in got:
                    continue
                key, latency = record.key.decode(), (now - body["sent_ns"]) / 1e6
                got[body["n"]] = (key, body["seq"], record.partition, latency)
                if len(got) <= SHOWN:
                    print(f"  {key:<8} partition {record.partition}  {latency:6.1f} ms")
        code = await asyncio.wait_for(producer.wait(), 60)
    finally:
        if producer.returncode is None:
            producer.kill()
            await producer.wait()
        await consumer.stop()
    return list(got.values()), code


def order_problems(received: list[Event]) -> list[str]:
    """Per key: one partition, and sequence numbers rising in arrival order."""
    problems, last = [], {}
    for key, seq, partition, _ in received:
        if key in last and (seq <= last[key][0] or partition != last[key][1]):
            problems.append(
                f"{key}: seq {seq} (partition {partition}) came after seq "
                f"{last[key][0]} (partition {last[key][1]})"
            )
        last[key] = (seq, partition)
    return problems


def report(received: list[Event], events: int) -> list[str]:
    """Print the results; return what failed."""
    problems = order_problems(received)
    failures = problems[:10]
    if len(received) < events:
        failures.append(f"{events - len(received)} of {events} events missing")
    print(f"\nreceived   {len(received)} / {events} events")
    if received:
        ms = sorted(r[3] for r in received)
        pcts = "  ".join(f"p{q} {ms[math.ceil(q * len(ms) / 100) - 1]:.1f}" for q in (50, 95, 99))
        print(f"latency ms {pcts}  max {ms[-1]:.1f}  (producer's INSERT -> consumer)")
    state = "BROKEN" if problems else "kept"
    print(f"order      {state} for {len({r[0] for r in received})} keys (one partition each)")
    return failures


def migrate(dsn: str) -> None:
    """``python -m notify_outbox migrate``, as an operator runs it."""
    done = subprocess.run(
        cli_argv("migrate"), env=relay_env(dsn), capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise RelayError(f"migrate failed: {done.stderr.strip()}")
    print(f"migrate: {done.stdout.strip()}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["_produce"]:
        asyncio.run(produce(os.environ[ENV[0]], int(argv[1]), float(argv[2]), argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200, help="events to send (default 200)")
    parser.add_argument("--rate", type=float, default=50.0, help="events per second (default 50)")
    parser.add_argument("--keep", action="store_true", help="leave the local stack running")
    args = parser.parse_args(argv)
    if args.events < 1 or not args.rate > 0:
        parser.error("--events must be at least 1 and --rate above 0")
    dsn, bootstrap = (os.environ.get(name, "") for name in ENV)
    if bool(dsn) != bool(bootstrap):
        parser.error(f"set both {ENV[0]} and {ENV[1]}, or neither to start a local stack")
    stack: Stack | None = None
    relay: RelayProcess | None = None
    failures: list[str] = []
    try:
        if not dsn:
            base = Path(tempfile.mkdtemp(prefix="notify-outbox-demo-"))
            base.chmod(0o711)  # PostgreSQL may run as another user (as root: "postgres")
            print(f"starting PostgreSQL and Kafka in {base} (Kafka takes a while) ...", flush=True)
            stack = Stack(base, durable=True)
            stack.start()
            dsn, bootstrap = stack.postgres.dsn, stack.kafka.bootstrap_servers
        migrate(dsn)
        asyncio.run(create_topics(bootstrap, [TOPIC], partitions=3, exist_ok=True))
        relay = RelayProcess(dsn, bootstrap)
        print(f"relay: {relay.wait_ready().split(': ', 1)[-1]}", flush=True)
        received, producer_code = asyncio.run(consume(dsn, bootstrap, args.events, args.rate))
        failures += report(received, args.events)
        if producer_code != 0:
            failures.append(f"the producer exited with code {producer_code}")
        code = relay.stop()
        print(f"relay      exit code {code} after SIGTERM")
        if code != 0:
            failures.append(f"the relay exited with code {code}:\n{relay.output(20)}")
    except (RelayError, StackError, KafkaError, OSError, TimeoutError, PostgresError) as e:
        failures.append(f"{type(e).__name__}: {e}")
    finally:
        if relay is not None:
            relay.close()
        if stack is not None and args.keep:
            print("\nthe stack keeps running; point a shell at it with:")
            for name, value in {ENV[0]: dsn, ENV[1]: bootstrap, **stack.env()}.items():
                print(f"export {name}={shlex.quote(value)}")
            stop = f'from devstack import Stack; Stack("{stack.base_dir}").stop()'
            print(f"# stop it: cd {ROOT} && {sys.executable} -c {shlex.quote(stop)}")
        elif stack is not None:
            stack.stop()
            shutil.rmtree(stack.base_dir, ignore_errors=True)
    for failure in failures:
        print(f"demo: FAILED: {failure}", file=sys.stderr)
    if not failures:
        print("\ndemo: OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
