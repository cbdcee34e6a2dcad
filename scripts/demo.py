"""End-to-end demo of notify-outbox: plain SQL in, Kafka out, with latency and ordering checked.

Run from the repository root with the project's virtualenv::

    .venv/bin/python scripts/demo.py [--events 200] [--rate 50] [--keep]

What it does:

1. Starts PostgreSQL and a KRaft Kafka broker (``devstack``, no Docker) in a fresh directory
   under the system temp dir, or uses ``NOTIFY_OUTBOX_DSN`` and
   ``NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS`` when both are set.
2. Runs ``python -m notify_outbox migrate``.
3. Creates the topic ``orders`` with 3 partitions (auto-creation is off on the local broker).
4. Starts the relay, ``python -m notify_outbox run``, and waits for its "relay running" log line.
5. Starts a Kafka consumer here, reading ``orders`` from the beginning.
6. Starts a separate producer process (this script again, in its internal ``_produce`` mode)
   that knows nothing of notify-outbox: it uses asyncpg and one literal SQL statement,
   ``INSERT INTO outbox (topic, key, payload) VALUES ('orders', $1, $2::jsonb)``, one
   transaction per event (``BEGIN``, ``INSERT``, ``COMMIT``), at a fixed rate, keys
   ``order-1`` .. ``order-20`` in turn. Each payload carries a per-key sequence number and
   ``sent_ns``.
7. Prints the first received events, then a summary: events received, latency percentiles and
   a per-key order check.
8. Stops the relay with SIGTERM (expecting exit code 0) and the stack (unless it came from the
   environment or ``--keep`` is given). Exits 1 if an event is missing, an order is broken or
   the relay did not exit cleanly; 2 on bad usage.

Latency: ``sent_ns`` is ``time.time_ns()`` read by the producer after ``BEGIN`` returned and
right before the ``INSERT`` (a payload cannot hold a time taken after its own commit). The
consumer reads ``time.time_ns()`` when the record reaches it. Both run on this host, so one
clock serves both ends, and latency = consumer receive time - ``sent_ns``. It therefore
includes the INSERT and COMMIT round trips (with the WAL flush of a durable commit), the NOTIFY
that wakes the relay, the relay's claim, its Kafka send and acknowledgement, and the consumer's
fetch. The summary splits it up: the producer's INSERT+COMMIT time, ``sent_ns`` -> the relay's
Kafka send (the record's CreateTime, stamped by aiokafka in the relay, millisecond resolution),
and that send -> the consumer.

Events of earlier runs (when the services are reused) are skipped: every payload carries this
run's id. Child processes get only ``NOTIFY_OUTBOX_DSN`` and
``NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS`` from the ``NOTIFY_OUTBOX_*`` family, so a table or
schema setting in the caller's shell cannot send the plain-SQL inserts and the relay to
different tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from devstack import Stack, StackError  # noqa: E402  (needs ROOT on sys.path)

TOPIC = "orders"
PARTITIONS = 3
KEYS = 20
SHOWN = 10
# The one statement the producer runs: plain SQL, as any language or psql could send it.
INSERT_SQL = "INSERT INTO outbox (topic, key, payload) VALUES ('orders', $1, $2::jsonb)"

DSN_ENV = "NOTIFY_OUTBOX_DSN"
BOOTSTRAP_ENV = "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS"

MIGRATE_TIMEOUT = 120.0
ADMIN_TIMEOUT = 30.0
RELAY_READY_TIMEOUT = 60.0
RELAY_STOP_TIMEOUT = 60.0  # above the relay's default shutdown_timeout of 30 s
CONSUMER_START_TIMEOUT = 30.0
DRAIN_TIMEOUT = 30.0  # after the producer is done, how long to wait for the last events
TOPIC_ERROR_NONE = 0
TOPIC_ERROR_ALREADY_EXISTS = 36


class DemoError(Exception):
    """A step failed; the message says which and why."""


def log(message: str) -> None:
    print(message, flush=True)


# --- child processes --------------------------------------------------------------------------


def child_env(dsn: str, bootstrap: str | None = None) -> dict[str, str]:
    """The environment of a child process: ours without NOTIFY_OUTBOX_*, plus the given ones."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOTIFY_OUTBOX_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env[DSN_ENV] = dsn
    if bootstrap is not None:
        env[BOOTSTRAP_ENV] = bootstrap
    return env


def run_migrate(dsn: str) -> None:
    try:
        result = subprocess.run(
            [sys.executable, "-m", "notify_outbox", "migrate"],
            cwd=ROOT,
            env=child_env(dsn),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=MIGRATE_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise DemoError(
            f"`notify_outbox migrate` did not finish within {MIGRATE_TIMEOUT:.0f}s"
        ) from None
    if result.returncode != 0:
        raise DemoError(
            f"`notify_outbox migrate` failed with exit code {result.returncode}:\n"
            f"{(result.stderr or result.stdout).strip()}"
        )
    log(f"migrate: {result.stdout.strip()}")


class RelayProcess:
    """``python -m notify_outbox run`` as a child; a thread reads its stderr as it comes."""

    def __init__(self, dsn: str, bootstrap: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "notify_outbox", "--log-level", "INFO", "run"],
            cwd=ROOT,
            env=child_env(dsn, bootstrap),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: deque[str] = deque(maxlen=200)
        self.warnings = 0
        self.ready_line: str | None = None
        self._eof = False
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="relay-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.rstrip("\n")
            with self._cond:
                self.lines.append(line)
                if " WARNING " in line or " ERROR " in line:
                    self.warnings += 1
                if self.ready_line is None and "relay running" in line:
                    self.ready_line = line
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.ready_line is None:
                if self._eof:
                    code = self.proc.wait(10)
                    raise DemoError(
                        f"the relay exited with code {code} before it was ready; its log:\n"
                        f"{self.log_tail()}"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DemoError(
                        f"the relay did not log 'relay running' within {timeout:.0f}s; its log:\n"
                        f"{self.log_tail()}"
                    )
                self._cond.wait(remaining)
            return self.ready_line

    def stop(self, timeout: float) -> int:
        """SIGTERM, then wait; returns the exit code (SIGKILL and raise after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise DemoError(
                f"the relay did not exit within {timeout:.0f}s of SIGTERM (killed); its log:\n"
                f"{self.log_tail()}"
            ) from None
        self._reader.join(10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        with self._cond:
            return "\n".join(f"  | {line}" for line in list(self.lines)[-lines:])


# --- Kafka ------------------------------------------------------------------------------------


async def create_topic(bootstrap: str) -> list[int]:
    """Create the topic unless it exists; return its partition ids once all have a leader."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="notify-outbox-demo")
    try:
        await asyncio.wait_for(admin.start(), ADMIN_TIMEOUT)
        response = await asyncio.wait_for(
            admin.create_topics([NewTopic(TOPIC, num_partitions=PARTITIONS, replication_factor=1)]),
            ADMIN_TIMEOUT,
        )
        for entry in response.topic_errors:
            name, code = entry[0], entry[1]
            if code == TOPIC_ERROR_ALREADY_EXISTS:
                log(f"topic {name!r} already exists: kept as it is")
            elif code != TOPIC_ERROR_NONE:
                raise DemoError(f"creating topic {name!r} failed with Kafka error code {code}")
        return await asyncio.wait_for(_leaders_elected(admin), ADMIN_TIMEOUT)
    except TimeoutError:
        raise DemoError(
            f"Kafka at {bootstrap} did not create topic {TOPIC!r} (or elect its partition "
            f"leaders) within {ADMIN_TIMEOUT:.0f}s"
        ) from None
    finally:
        await admin.close()


async def _leaders_elected(admin: Any) -> list[int]:
    # A topic exists before its partitions have leaders; a consumer that starts in between
    # sees errors. Metadata has no "wait", so this asks again until it is complete.
    while True:
        for topic in await admin.describe_topics([TOPIC]):
            partitions = topic["partitions"]
            if (
                topic["topic"] == TOPIC
                and topic["error_code"] == TOPIC_ERROR_NONE
                and partitions
                and all(
                    p["error_code"] == TOPIC_ERROR_NONE and p["leader"] >= 0 for p in partitions
                )
            ):
                return sorted(int(p["partition"]) for p in partitions)
        await asyncio.sleep(0.1)


@dataclass
class Received:
    n: int
    key: str
    seq: int
    partition: int
    offset: int
    latency_ms: float
    # sent_ns -> the record's CreateTime, which aiokafka stamps in the relay at send().
    to_send_ms: float | None


@dataclass
class ConsumeResult:
    events: list[Received] = field(default_factory=list)
    duplicates: int = 0
    other_runs: int = 0
    unreadable: int = 0
    partitions: int = 0


@dataclass
class ProducerReport:
    exit_code: int
    sent: int = 0
    seconds: float = 0.0
    commit_ms: list[float] = field(default_factory=list)
    error: str = ""


async def start_consumer(bootstrap: str, partitions: Sequence[int]) -> tuple[Any, list[Any]]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        client_id="notify-outbox-demo",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    tps = [TopicPartition(TOPIC, p) for p in partitions]
    try:
        await asyncio.wait_for(consumer.start(), CONSUMER_START_TIMEOUT)
        consumer.assign(tps)
        await asyncio.wait_for(consumer.seek_to_beginning(*tps), CONSUMER_START_TIMEOUT)
    except TimeoutError:
        await consumer.stop()
        raise DemoError(
            f"the consumer could not start within {CONSUMER_START_TIMEOUT:.0f}s"
        ) from None
    except BaseException:
        await consumer.stop()
        raise
    return consumer, tps


async def run_producer(dsn: str, events: int, rate: float, run_id: str) -> ProducerReport:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SCRIPT),
        "_produce",
        "--events",
        str(events),
        "--rate",
        str(rate),
        "--run-id",
        run_id,
        cwd=ROOT,
        env=child_env(dsn),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    timeout = events / rate * 2 + 60
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return ProducerReport(-9, error=f"the producer did not finish within {timeout:.0f}s")
    except asyncio.CancelledError:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    code = proc.returncode if proc.returncode is not None else -1
    report = ProducerReport(code, error=err.decode(errors="replace").strip())
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("{"):
            data = json.loads(line)
            report.sent = int(data["sent"])
            report.seconds = float(data["seconds"])
            report.commit_ms = [float(x) for x in data["commit_ms"]]
    return report


async def consume_while_producing(
    dsn: str, bootstrap: str, partitions: Sequence[int], events: int, rate: float
) -> tuple[ConsumeResult, ProducerReport]:
    run_id = uuid.uuid4().hex[:12]
    consumer, tps = await start_consumer(bootstrap, partitions)
    result = ConsumeResult(partitions=len(tps))
    log(f"consumer reading {TOPIC!r} ({len(tps)} partitions) from the beginning")
    log(f"producer: {events} events at {rate:g}/s, plain SQL, one transaction each (run {run_id})")
    producer = asyncio.create_task(run_producer(dsn, events, rate, run_id))
    seen: set[int] = set()
    deadline = time.monotonic() + events / rate * 2 + 60 + DRAIN_TIMEOUT
    last_progress = time.monotonic()
    try:
        while len(seen) < events and time.monotonic() < deadline:
            if producer.done():
                if producer.result().exit_code != 0:
                    break
                if time.monotonic() - last_progress > DRAIN_TIMEOUT:
                    break
            batch = await consumer.getmany(*tps, timeout_ms=200)
            received_ns = time.time_ns()
            for records in batch.values():
                for record in records:
                    try:
                        body = json.loads(record.value)
                        if body.get("run") != run_id:
                            result.other_runs += 1
                            continue
                        n, seq, sent_ns = int(body["n"]), int(body["seq"]), int(body["sent_ns"])
                    except (TypeError, ValueError, KeyError, AttributeError):
                        result.unreadable += 1
                        continue
                    if n in seen:
                        result.duplicates += 1
                        continue
                    seen.add(n)
                    last_progress = time.monotonic()
                    key = record.key.decode() if record.key is not None else "?"
                    create_time = record.timestamp if record.timestamp_type == 0 else None
                    got = Received(
                        n,
                        key,
                        seq,
                        record.partition,
                        record.offset,
                        (received_ns - sent_ns) / 1e6,
                        None if create_time is None else create_time - sent_ns / 1e6,
                    )
                    result.events.append(got)
                    if len(result.events) <= SHOWN:
                        log(
                            f"  received #{n:<4} key={got.key:<9} seq={seq:<3} "
                            f"partition={got.partition} offset={got.offset:<5} "
                            f"latency={got.latency_ms:7.2f} ms"
                        )
                    elif len(result.events) == SHOWN + 1:
                        log("  ... (the rest counted silently)")
        report = await asyncio.wait_for(producer, events / rate * 2 + 60)
    finally:
        if not producer.done():
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
        await consumer.stop()
    return result, report


# --- the producer process ---------------------------------------------------------------------


async def produce(dsn: str, events: int, rate: float, run_id: str) -> None:
    """The producer process: plain SQL only, nothing from notify_outbox."""
    conn = await asyncpg.connect(dsn, timeout=30)
    commit_ms: list[float] = []
    try:
        started = time.monotonic()
        for i in range(events):
            # A fixed schedule: event i is due at i/rate seconds, whatever the last one took.
            delay = started + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            key = f"order-{i % KEYS + 1}"
            await conn.execute("BEGIN")
            sent_ns = time.time_ns()
            payload = {"run": run_id, "n": i + 1, "seq": i // KEYS + 1, "sent_ns": sent_ns}
            await conn.execute(INSERT_SQL, key, json.dumps(payload))
            await conn.execute("COMMIT")
            commit_ms.append((time.time_ns() - sent_ns) / 1e6)
        seconds = time.monotonic() - started
    finally:
        await conn.close()
    print(json.dumps({"sent": events, "seconds": seconds, "commit_ms": commit_ms}), flush=True)


def produce_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="demo.py _produce")
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--run-id", required=True)
    args = parser.parse_args(argv)
    dsn = os.environ.get(DSN_ENV)
    if not dsn:
        print(f"producer: {DSN_ENV} is not set", file=sys.stderr)
        return 2
    try:
        asyncio.run(produce(dsn, args.events, args.rate, args.run_id))
    except (OSError, asyncpg.PostgresError, TimeoutError) as e:
        print(f"producer: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


# --- summary ----------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty sequence."""
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def describe_ms(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    s = sorted(values)
    parts = [f"p{q:g} {percentile(s, q):.1f}" for q in (50, 95, 99)]
    return "  ".join([*parts, f"max {s[-1]:.1f}"])


def order_problems(events: Sequence[Received]) -> list[str]:
    """Per key: one partition, and sequence numbers increasing in the order received (which is
    offset order within a partition)."""
    problems: list[str] = []
    last: dict[str, Received] = {}
    partitions: dict[str, set[int]] = {}
    for event in events:
        partitions.setdefault(event.key, set()).add(event.partition)
        previous = last.get(event.key)
        if previous is not None and event.seq <= previous.seq:
            problems.append(
                f"key {event.key}: seq {event.seq} (offset {event.offset}) arrived after "
                f"seq {previous.seq} (offset {previous.offset})"
            )
        last[event.key] = event
    problems.extend(
        f"key {key} is spread over partitions {sorted(parts)}"
        for key, parts in partitions.items()
        if len(parts) > 1
    )
    return problems


def summarize(
    result: ConsumeResult, report: ProducerReport, expected: int, rate: float
) -> list[str]:
    """Print the summary; return the failures."""
    failures: list[str] = []
    got = len(result.events)
    log("")
    log("== summary ==")
    extras = f"{result.duplicates} duplicates, {result.other_runs} from earlier runs skipped" + (
        f", {result.unreadable} unreadable" if result.unreadable else ""
    )
    log(f"received      {got} / {expected} events ({extras})")
    if got < expected:
        failures.append(f"{expected - got} of {expected} events did not arrive")
    log(
        f"latency ms    {describe_ms([e.latency_ms for e in result.events])}  (sent_ns -> consumer)"
    )
    log(f"  breakdown   {'producer INSERT+COMMIT':<26}{describe_ms(report.commit_ms)}")
    stamped = [e for e in result.events if e.to_send_ms is not None]
    if stamped:
        # CreateTime has millisecond resolution, so these two are +-1 ms.
        to_send = [e.to_send_ms for e in stamped if e.to_send_ms is not None]
        via_kafka = [e.latency_ms - (e.to_send_ms or 0.0) for e in stamped]
        log(f"              {'sent_ns -> relay send':<26}{describe_ms(to_send)}")
        log(f"              {'relay send -> consumer':<26}{describe_ms(via_kafka)}")
    problems = order_problems(result.events)
    keys = len({e.key for e in result.events})
    if problems:
        log(f"order         VIOLATED ({len(problems)} problems):")
        for problem in problems[:10]:
            log(f"  {problem}")
        failures.append("per-key order violated")
    else:
        log(f"order         kept for all {keys} keys (each key on one partition, seq increasing)")
    if report.exit_code == 0 and report.seconds > 0:
        log(
            f"producer      {report.sent} events in {report.seconds:.1f}s "
            f"({report.sent / report.seconds:.1f}/s, target {rate:g}/s)"
        )
    else:
        log(f"producer      FAILED (exit code {report.exit_code}): {report.error}")
        failures.append(f"the producer failed (exit code {report.exit_code})")
    return failures


# --- main -------------------------------------------------------------------------------------


def exports(dsn: str, bootstrap: str, stack: Stack | None) -> str:
    env = {DSN_ENV: dsn, BOOTSTRAP_ENV: bootstrap}
    if stack is not None:
        env.update(stack.env())
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="notify-outbox end to end: plain SQL inserts -> relay -> Kafka consumer."
    )
    parser.add_argument("--events", type=int, default=200, help="events to send (default 200)")
    parser.add_argument("--rate", type=float, default=50.0, help="events per second (default 50)")
    parser.add_argument(
        "--keep", action="store_true", help="leave the local stack running, print its exports"
    )
    args = parser.parse_args(argv)
    if args.events < 1:
        parser.error("--events must be at least 1")
    if not args.rate > 0:
        parser.error("--rate must be above 0")
    return args


def run(args: argparse.Namespace) -> int:
    env_dsn, env_bootstrap = os.environ.get(DSN_ENV), os.environ.get(BOOTSTRAP_ENV)
    if bool(env_dsn) != bool(env_bootstrap):
        print(
            f"demo: set both {DSN_ENV} and {BOOTSTRAP_ENV} to use your services, or neither "
            "to start a local stack",
            file=sys.stderr,
        )
        return 2
    stack: Stack | None = None
    base_dir: Path | None = None
    relay: RelayProcess | None = None
    failures: list[str] = []
    keep_stack = False
    try:
        if env_dsn and env_bootstrap:
            dsn, bootstrap = env_dsn, env_bootstrap
            log(f"using the services from {DSN_ENV} and {BOOTSTRAP_ENV}")
        else:
            base_dir = Path(tempfile.mkdtemp(prefix="notify-outbox-demo-"))
            # PostgreSQL may run as another user (as root: "postgres"); it must reach data/.
            base_dir.chmod(0o711)
            log(f"starting PostgreSQL and Kafka in {base_dir} (Kafka takes a while) ...")
            started = time.monotonic()
            stack = Stack(base_dir, durable=True)
            stack.start()
            dsn, bootstrap = stack.postgres.dsn, stack.kafka.bootstrap_servers
            log(
                f"stack up in {time.monotonic() - started:.1f}s: PostgreSQL "
                f"127.0.0.1:{stack.postgres.port}, Kafka {bootstrap}"
            )
        run_migrate(dsn)
        partitions = asyncio.run(create_topic(bootstrap))
        log(f"topic {TOPIC!r}: partitions {partitions}, all with a leader")
        relay = RelayProcess(dsn, bootstrap)
        ready = relay.wait_ready(RELAY_READY_TIMEOUT)
        log(f"relay: {ready.split(': ', 1)[-1]}")
        result, report = asyncio.run(
            consume_while_producing(dsn, bootstrap, partitions, args.events, args.rate)
        )
        failures += summarize(result, report, args.events, args.rate)
        code = relay.stop(RELAY_STOP_TIMEOUT)
        log(
            f"relay         exit code {code} after SIGTERM"
            + (f" ({relay.warnings} warnings/errors logged)" if relay.warnings else "")
        )
        if code != 0:
            failures.append(f"the relay exited with code {code}, not 0")
        if failures and relay.lines:
            log(f"relay log (last lines):\n{relay.log_tail()}")
        if args.keep:
            keep_stack = stack is not None
            log("")
            if stack is not None:
                log(f"the stack keeps running in {base_dir}; point a shell at it with:")
            sys.stdout.write(exports(dsn, bootstrap, stack))
            if stack is not None:
                log(
                    f"# stop it: cd {shlex.quote(str(ROOT))} && {shlex.quote(sys.executable)} -c "
                    f"'from devstack import Stack; Stack(\"{base_dir}\").stop()' "
                    f"&& rm -rf {shlex.quote(str(base_dir))}"
                )
    except Exception as e:  # reported below, after the cleanup
        message = str(e) if isinstance(e, DemoError | StackError) else f"{type(e).__name__}: {e}"
        failures.append(message)
        if relay is not None and "  | " not in message:
            log(f"relay log (last lines):\n{relay.log_tail()}")
    finally:
        if relay is not None:
            relay.kill()
        if stack is not None and not keep_stack:
            log(f"stopping the stack in {base_dir}")
            try:
                stack.stop()
            except (StackError, OSError) as e:
                failures.append(f"could not stop the stack in {base_dir}: {e}; left in place")
            else:
                if base_dir is not None:
                    shutil.rmtree(base_dir, ignore_errors=True)
        elif base_dir is not None and stack is None:
            shutil.rmtree(base_dir, ignore_errors=True)
    if failures:
        log("")
        for failure in failures:
            print(f"demo: FAILED: {failure}", file=sys.stderr)
        return 1
    log("")
    log("demo: OK")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_produce"]:
        return produce_main(argv[1:])
    args = parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:  # run() has cleaned up by the time this arrives
        print("demo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
