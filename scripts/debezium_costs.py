"""What the Debezium mode's capture trigger costs producers (docs/debezium-costs.md).

Debezium reads the outbox table from the WAL: a producer's INSERT is an INSERT, nothing more.
notify-outbox's capture trigger copies the row into its own outbox in the producer's
transaction, and that table's trigger takes the per-key producer lock
(``pg_advisory_xact_lock(ns, hashtext(key))``, held until commit) so that rows of one key
commit in id order. This script measures, on a fresh database of the given server:

- commits/s of W concurrent producers, each transaction one INSERT into the Debezium-shaped
  table, with and without the capture, with every transaction on its own ``aggregateid`` or
  all on one, and with the transaction holding on for ``hold`` ms after its INSERT (the rest
  of the business transaction);
- what two transactions writing events for two aggregates in opposite orders get.

Usage: ``NOTIFY_OUTBOX_DSN=postgresql://postgres@127.0.0.1:5432/postgres
.venv/bin/python scripts/debezium_costs.py [--writers 8] [--seconds 5]`` (a superuser DSN:
the script creates and drops its own database).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from notify_outbox import OutboxNames, migrate
from notify_outbox.debezium import DebeziumCapture, install_capture

TABLE = """
CREATE TABLE {name} (
    id            uuid                   NOT NULL PRIMARY KEY,
    aggregatetype character varying(255) NOT NULL,
    aggregateid   character varying(255) NOT NULL,
    type          character varying(255) NOT NULL,
    payload       jsonb
)
"""
INSERT = "INSERT INTO {name} VALUES ($1, 'order', $2, 'OrderPlaced', '{{\"total\": 12}}'::jsonb)"


def dsn_for(dsn: str, database: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{database}"))


async def writers(
    dsn: str, table: str, *, writers: int, seconds: float, same_key: bool, hold_ms: float
) -> dict[str, Any]:
    """Commits/s of ``writers`` producers for ``seconds``."""
    sql = INSERT.format(name=table)
    conns = [await asyncpg.connect(dsn) for _ in range(writers)]
    commits = [0] * writers
    latencies: list[float] = []
    stop = time.monotonic() + seconds

    async def run(i: int, conn: asyncpg.Connection) -> None:
        n = 0
        while time.monotonic() < stop:
            key = "customer-1" if same_key else f"customer-{i}-{n}"
            t0 = time.perf_counter()
            async with conn.transaction():
                await conn.execute(sql, uuid.uuid4(), key)
                if hold_ms:
                    await conn.execute("SELECT pg_sleep($1)", hold_ms / 1000)
            latencies.append(time.perf_counter() - t0)
            n += 1
        commits[i] = n

    try:
        await asyncio.gather(*(run(i, c) for i, c in enumerate(conns)))
    finally:
        for c in conns:
            await c.close()
    latencies.sort()
    return {
        "commits_per_s": round(sum(commits) / seconds, 1),
        "p50_ms": round(1000 * latencies[len(latencies) // 2], 2),
        "p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 2),
    }


async def opposite_orders(dsn: str, table: str) -> str:
    """T1 writes events for A then B, T2 for B then A, interleaved: what happens."""
    sql = INSERT.format(name=table)
    c1, c2 = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    t1, t2 = c1.transaction(), c2.transaction()
    try:
        await t1.start()
        await t2.start()
        await c1.execute(sql, uuid.uuid4(), "aggregate-A")
        await c2.execute(sql, uuid.uuid4(), "aggregate-B")
        started = time.perf_counter()
        second = asyncio.gather(
            c1.execute(sql, uuid.uuid4(), "aggregate-B"),
            c2.execute(sql, uuid.uuid4(), "aggregate-A"),
            return_exceptions=True,
        )
        outcomes = await asyncio.wait_for(second, 30)
        took = time.perf_counter() - started
        errors = [type(o).__name__ for o in outcomes if isinstance(o, BaseException)]
        for tx, outcome in ((t1, outcomes[0]), (t2, outcomes[1])):
            if isinstance(outcome, BaseException):
                await tx.rollback()
            else:
                await tx.commit()
        if errors:
            return f"{', '.join(errors)} after {took:.2f} s; the other transaction commits"
        return f"both commit ({took * 1000:.1f} ms)"
    finally:
        await c1.close()
        await c2.close()


async def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--holds", type=float, nargs="+", default=[0.0, 5.0])
    args = p.parse_args(argv)
    admin_dsn = os.environ["NOTIFY_OUTBOX_DSN"]
    name = f"debezium_costs_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(admin_dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    dsn = dsn_for(admin_dsn, name)
    results: dict[str, Any] = {"writers": args.writers, "seconds": args.seconds, "cells": []}
    try:
        conn = await asyncpg.connect(dsn)
        try:
            relay_table = OutboxNames(table="relay_outbox")
            await migrate(conn, relay_table)
            await conn.execute(TABLE.format(name="outbox"))  # with the capture
            await conn.execute(TABLE.format(name="plain_outbox"))  # what Debezium reads
            await install_capture(conn, DebeziumCapture(), relay_table)
            results["server"] = await conn.fetchval("SHOW server_version")
            results["synchronous_commit"] = await conn.fetchval("SHOW synchronous_commit")
            results["deadlock_timeout"] = await conn.fetchval("SHOW deadlock_timeout")
        finally:
            await conn.close()
        results["loadavg_before"] = [round(x, 2) for x in os.getloadavg()]
        for hold in args.holds:
            for same_key in (False, True):
                for table, label in (
                    ("plain_outbox", "Debezium (plain INSERT)"),
                    ("outbox", "notify-outbox Debezium mode"),
                ):
                    cell = await writers(
                        dsn,
                        table,
                        writers=args.writers,
                        seconds=args.seconds,
                        same_key=same_key,
                        hold_ms=hold,
                    )
                    cell |= {"producer": label, "same_key": same_key, "hold_ms": hold}
                    results["cells"].append(cell)
                    print(json.dumps(cell), file=sys.stderr, flush=True)
        results["opposite_orders"] = {
            "Debezium (plain INSERT)": await opposite_orders(dsn, "plain_outbox"),
            "notify-outbox Debezium mode": await opposite_orders(dsn, "outbox"),
        }
        results["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
