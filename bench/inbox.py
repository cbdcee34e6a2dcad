"""The inbox regime (``python -m bench inbox``): messages per second of a consumer group
draining a backlog through the inbox into a fresh database, per mode (``apply``, ``consume``,
``consume_batches``, ``consume_batches_parallel``, and ``baseline``: the simple batched inbox of
issue 18, below). Every mode runs in this process; the clock runs from the partitions' assignment
(the join apart, ``join_seconds``) until every message is committed. See ``bench/README.md``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from bench.config import JsonRecord, add_options, from_args, output_options
from bench.phase import loadavg, utc
from bench.procs import BenchError
from bench.regimes import Regime
from bench.services import (
    close_services,
    connection,
    dsn_for,
    make_work_dir,
    open_services,
    remove_work_dir,
)
from devstack.relayproc import create_topics
from notify_outbox.inbox import Inbox, consume, consume_batches, migrate_inbox

MODES = ("apply", "consume", "consume_batches", "consume_batches_parallel", "baseline")
APPLIED_SQL = "CREATE TABLE applied (event_id text NOT NULL, value bytea)"
BASELINE_SQL = """
CREATE TABLE baseline_inbox (event_id uuid PRIMARY KEY);
CREATE TABLE baseline_applied (event_id text NOT NULL, value bytea)
"""


@dataclass
class InboxBenchConfig(JsonRecord):
    """What one ``python -m bench inbox`` run does."""

    messages: int = 20_000
    partitions: int = 4
    modes: list[str] = field(default_factory=lambda: list(MODES))
    repeat: int = 3
    max_records: int = 500
    cell_timeout: float = 300.0


HELP = (
    "consumer side: a backlog drained through the inbox (per message, batch path, the simple "
    "batched baseline), msg/s"
)


def arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m bench inbox``."""
    add_options(
        p,
        InboxBenchConfig,
        messages="backlog size (default 20000)",
        partitions="topic partitions (default 4)",
        modes=(
            "default: all five (apply consume consume_batches consume_batches_parallel baseline)",
            {"choices": list(MODES), "default": None},
        ),
        repeat="rounds (modes interleaved; medians)",
        max_records="getmany max_records",
    )
    output_options(p)


def configure(args: argparse.Namespace) -> InboxBenchConfig:
    """The config of ``python -m bench inbox ...`` (a BenchError for a bad value)."""
    if args.messages < 1 or args.repeat < 1 or args.partitions < 1 or args.max_records < 1:
        raise BenchError("--messages, --partitions, --repeat and --max-records must be >= 1")
    return from_args(InboxBenchConfig, args, modes=list(dict.fromkeys(args.modes or MODES)))


Done = Callable[[int], None]
# A drain subscribes the consumer to the topic (its last argument) and applies until cancelled.
Drain = Callable[[AIOKafkaConsumer, asyncpg.Pool, Done, str], Coroutine[Any, Any, None]]


def _header_id(record: Any) -> str:
    for k, v in record.headers:
        if k == "outbox-event-id":
            return bytes(v).decode()
    raise ValueError("no outbox-event-id header")


async def _baseline(consumer: AIOKafkaConsumer, pool: asyncpg.Pool, done: Done, topic: str) -> None:
    """The simple batched inbox the issue measured: nothing but the fast path."""
    consumer.subscribe([topic])
    while True:
        batch = await consumer.getmany(timeout_ms=500, max_records=500)
        for tp, records in batch.items():
            ids = [uuid.UUID(_header_id(r)) for r in records]
            async with pool.acquire() as conn, conn.transaction():
                fresh = {
                    r[0]
                    for r in await conn.fetch(
                        "INSERT INTO baseline_inbox SELECT unnest($1::uuid[]) "
                        "ON CONFLICT DO NOTHING RETURNING event_id",
                        ids,
                    )
                }
                rows = [(i, r.value) for i, r in zip(ids, records, strict=True) if i in fresh]
                # The business rows are the other modes' (text ids), so that only the inbox
                # differs between them.
                await conn.execute(
                    "INSERT INTO baseline_applied SELECT * FROM unnest($1::text[], $2::bytea[])",
                    [str(i) for i, _ in rows],
                    [v for _, v in rows],
                )
            await consumer.commit({tp: records[-1].offset + 1})
            done(len(records))


def _drains(cfg: InboxBenchConfig) -> dict[str, Drain]:
    async def one(conn: asyncpg.Connection, record: Any) -> None:
        await conn.execute("INSERT INTO applied VALUES ($1, $2)", _header_id(record), record.value)

    async def bulk(conn: asyncpg.Connection, records: list[Any]) -> None:
        await conn.execute(
            "INSERT INTO applied SELECT * FROM unnest($1::text[], $2::bytea[])",
            [_header_id(r) for r in records],
            [r.value for r in records],
        )

    async def apply_mode(c: AIOKafkaConsumer, pool: asyncpg.Pool, done: Done, topic: str) -> None:
        inbox = Inbox(consumer="bench")
        c.subscribe([topic])
        while True:
            batch = await c.getmany(timeout_ms=500, max_records=cfg.max_records)
            for tp, records in batch.items():
                for r in records:
                    await inbox.apply(pool, r, one)
                await c.commit({tp: records[-1].offset + 1})
                done(len(records))

    async def loop_mode(
        c: AIOKafkaConsumer,
        pool: asyncpg.Pool,
        done: Done,
        topic: str,
        batches: bool,
        concurrency: int = 1,
    ) -> None:
        inbox = Inbox(consumer="bench")
        # The loops' progress: the inbox's committed count, read by the watcher below.
        watcher = asyncio.create_task(_watch(inbox, done))
        try:
            if batches:
                await consume_batches(
                    c,
                    pool,
                    bulk,
                    inbox=inbox,
                    max_records=cfg.max_records,
                    topics=[topic],
                    concurrency=concurrency,
                )
            else:
                await consume(
                    c, pool, one, inbox=inbox, max_records=cfg.max_records, topics=[topic]
                )
        finally:
            watcher.cancel()

    return {
        "apply": apply_mode,
        "consume": lambda c, p, d, t: loop_mode(c, p, d, t, False),
        "consume_batches": lambda c, p, d, t: loop_mode(c, p, d, t, True),
        "consume_batches_parallel": lambda c, p, d, t: loop_mode(c, p, d, t, True, cfg.partitions),
        "baseline": _baseline,
    }


async def _watch(inbox: Inbox, done: Done) -> None:
    reported = 0
    while True:
        n = inbox.counts["applied"] + inbox.counts["duplicate"]
        if n > reported:
            done(n - reported)
            reported = n
        await asyncio.sleep(0.005)


async def _produce(bootstrap: str, topic: str, n: int) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks="all")
    await producer.start()
    try:
        for i in range(n):
            eid = str(uuid.uuid4())
            await producer.send(
                topic,
                json.dumps({"n": i, "total": i % 500}).encode(),
                key=f"customer-{i % 1000}".encode(),
                headers=[("outbox-event-id", eid.encode())],
            )
        await producer.flush()
    finally:
        await producer.stop()


async def _cell(
    cfg: InboxBenchConfig, dsn: str, bootstrap: str, topic: str, mode: str, drain: Drain
) -> dict[str, Any]:
    async with connection(dsn) as conn:
        await migrate_inbox(conn)
        await conn.execute(APPLIED_SQL)
        await conn.execute(BASELINE_SQL)
    # A connection per partition for the parallel mode (its concurrency), two for the others.
    size = cfg.partitions + 1 if mode == "consume_batches_parallel" else 2
    pool = await asyncpg.create_pool(dsn, min_size=size, max_size=size)
    consumer = AIOKafkaConsumer(  # subscribed by the drain (the loops: with their listener)
        bootstrap_servers=bootstrap,
        group_id=f"bench-inbox-{mode}-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=4 * 1024 * 1024,
    )
    finished = asyncio.Event()
    count = 0

    def done(n: int) -> None:
        nonlocal count
        count += n
        if count >= cfg.messages:
            finished.set()

    started = time.perf_counter()
    await consumer.start()
    task = asyncio.create_task(drain(consumer, pool, done, topic))
    try:
        # The clock starts once the group gave the consumer its partitions: joining a group
        # takes a while and is the same for every mode, so it is reported apart.
        with anyio.fail_after(60):
            while True:
                if consumer.assignment() or task.done():
                    break
                await asyncio.sleep(0.001)
        assigned = time.perf_counter()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        waiter = asyncio.create_task(finished.wait())
        await asyncio.wait({task, waiter}, timeout=cfg.cell_timeout, return_when="FIRST_COMPLETED")
        if task.done():
            task.result()  # raises what broke the drain
            raise BenchError(f"{mode}: the drain stopped by itself")
        if not finished.is_set():
            raise BenchError(f"{mode}: {count} of {cfg.messages} in {cfg.cell_timeout} s")
        ended = time.perf_counter()
        seconds = ended - assigned
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await consumer.stop()
        await pool.close()
    async with connection(dsn) as conn:
        table = "baseline_applied" if mode == "baseline" else "applied"
        rows = await conn.fetchval(f"SELECT count(*) FROM {table}")
        distinct = await conn.fetchval(f"SELECT count(DISTINCT event_id) FROM {table}")
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {
        "mode": mode,
        "messages": cfg.messages,
        "seconds": round(seconds, 3),
        "join_seconds": round(assigned - started, 3),
        "msg_per_s": round(cfg.messages / seconds, 1),
        "consumer_cpu_us_per_msg": round(1e6 * cpu / cfg.messages, 1),
        "rows": rows,
        "distinct": distinct,
    }


async def run_inbox_bench(cfg: InboxBenchConfig, out: Path, *, keep: bool = False) -> Path:
    """Run every round, write ``inbox-<timestamp>.json`` under ``out``; returns its path."""
    work = make_work_dir()
    services = await open_services(work)
    started = utc()
    result: dict[str, Any] = {
        "phase": "inbox",
        "started": started,
        "config": cfg.to_json(),
        "environment": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": loadavg(),
            "services": "bench devstack" if services.own_stack else "from the environment",
        },
        "cells": [],
    }
    stamp = started.replace("-", "").replace(":", "")
    path = out / f"inbox-{stamp}.json"
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    try:
        topic = f"bench-inbox-{uuid.uuid4().hex[:8]}"
        await create_topics(services.bootstrap, [topic], partitions=cfg.partitions)
        await _produce(services.bootstrap, topic, cfg.messages)
        drains = _drains(cfg)
        for round_ in range(cfg.repeat):
            for mode in cfg.modes:
                name = f"bench_inbox_{mode}_{round_}"
                await services.admin(
                    f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', f'CREATE DATABASE "{name}"'
                )
                services.databases.append(name)
                cell = await _cell(
                    cfg, dsn_for(services.dsn, name), services.bootstrap, topic, mode, drains[mode]
                )
                cell["round"] = round_
                cell["loadavg_after"] = loadavg()
                result["cells"].append(cell)
                print(
                    f"inbox bench: round {round_ + 1}/{cfg.repeat} {mode}: "
                    f"{cell['msg_per_s']:.0f} msg/s ({cell['seconds']:.2f} s)",
                    flush=True,
                )
                await services.drop_database(name)
    finally:
        result["environment"]["loadavg_after"] = loadavg()
        result["finished"] = utc()
        result["summary"] = summarize(result)
        await asyncio.to_thread(path.write_text, json.dumps(result, indent=2) + "\n")
        await close_services(services)
        if not keep:
            remove_work_dir(work)
    return path


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per mode: the median msg/s over rounds, and its ratio to the baseline's."""
    cells = result["cells"]
    by: dict[str, list[float]] = {}
    for c in cells:
        by.setdefault(c["mode"], []).append(c["msg_per_s"])
    summary: dict[str, Any] = {
        m: {"median_msg_per_s": round(statistics.median(v), 1), "runs": v} for m, v in by.items()
    }
    base = summary.get("baseline", {}).get("median_msg_per_s")
    if base:
        for s in summary.values():
            s["vs_baseline"] = round(s["median_msg_per_s"] / base, 3)
        # Each round's ratio to that round's baseline: the modes of one round ran back to
        # back, so a load that drifts between rounds (a shared host) cancels out.
        base_of = {c["round"]: c["msg_per_s"] for c in cells if c["mode"] == "baseline"}
        for mode, s in summary.items():
            paired = [
                c["msg_per_s"] / base_of[c["round"]]
                for c in cells
                if c["mode"] == mode and c.get("round") in base_of
            ]
            if paired:
                s["paired_vs_baseline"] = [round(r, 3) for r in paired]
                s["median_paired_vs_baseline"] = round(statistics.median(paired), 3)
    return summary


def problems(result: dict[str, Any]) -> list[str]:
    """What makes a run fail: a message applied twice or missing in any cell."""
    return [
        f"{c['mode']} round {c['round']}: {c['rows']} rows, {c['distinct']} distinct, "
        f"{c['messages']} messages"
        for c in result["cells"]
        if not (c["rows"] == c["distinct"] == c["messages"])
    ]


def markdown(result: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    """The report of an inbox run (``inbox-<ts>.md``)."""
    cfg = result["config"]
    env = result["environment"]
    lines = [
        f"# Inbox backlog drain ({result['started']})",
        "",
        f"{cfg['messages']} messages on {cfg['partitions']} partitions, one consumer, "
        f"max_records {cfg['max_records']}, {cfg['repeat']} rounds (modes interleaved), "
        f"{env['cpus']} CPUs, load average before {env['loadavg_before']}, after "
        f"{env['loadavg_after']}; services: {env['services']}.",
        "",
        "| mode | median msg/s | vs baseline (medians) | vs baseline (per round; median) "
        "| runs (msg/s) | consumer CPU µs/msg (median) |",
        "|---|---|---|---|---|---|",
    ]
    for mode, s in summary.items():
        cpu = statistics.median(
            c["consumer_cpu_us_per_msg"] for c in result["cells"] if c["mode"] == mode
        )
        runs = ", ".join(f"{v:,.0f}" for v in s["runs"])
        vs = f"{s['vs_baseline']:.2f}x" if "vs_baseline" in s else "-"
        paired = (
            ", ".join(f"{r:.2f}" for r in s["paired_vs_baseline"])
            + f"; {s['median_paired_vs_baseline']:.2f}x"
            if "paired_vs_baseline" in s
            else "-"
        )
        lines.append(
            f"| {mode} | {s['median_msg_per_s']:,.0f} | {vs} | {paired} | {runs} | {cpu:.0f} |"
        )
    wrong = problems(result)
    lines += ["", "Every cell applied each message exactly once." if not wrong else ""]
    lines += [f"- PROBLEM: {p}" for p in wrong]
    lines += [line for name in plots for line in ("", f"![inbox drain]({name})")]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], summary: dict[str, Any], png: Path) -> bool:
    """Msg/s per mode: the median of the rounds (bars) and every round (dots)."""
    from bench.plots import plt  # matplotlib only when plotting

    modes = list(summary)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(modes, [summary[m]["median_msg_per_s"] for m in modes], color="#8fb3d9")
    for i, m in enumerate(modes):
        ax.scatter([i] * len(summary[m]["runs"]), summary[m]["runs"], color="black", s=12)
        ax.annotate(
            f"{summary[m]['median_msg_per_s']:,.0f}",
            (i, summary[m]["median_msg_per_s"]),
            ha="center",
            va="bottom",
        )
    ax.set_ylabel("messages/s (bar: median, dots: runs)")
    ax.set_title(f"Inbox backlog drain, {result['config']['messages']} messages")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


REGIME = Regime.of(__name__, run_inbox_bench)
