"""What NOTIFY costs producers and the listener with many outboxes in one database (issue #34;
docs/concepts/many-outboxes.md).

On a scratch database it migrates N outboxes (schemas ``t000``..), with the project's own
migrations, and measures:

- ``producers``: commits/s of W pgbench writers, single-row INSERTs on distinct keys spread
  evenly over the N outboxes, for each NOTIFY variant of the outboxes' statement trigger:
  ``shared`` (the shipped trigger with every outbox on the default channel ``notify_outbox``
  and an empty payload, as migrated today), ``per_channel`` (a channel per outbox,
  ``notify_outbox_tNNN``, empty payload), ``payload`` (one channel, the outbox ``tNNN.outbox``
  in the payload) and ``none`` (the trigger disabled: the ceiling); in notify mode ``always``
  and ``gated`` (no relay awake, so gated producers notify too). Cells alternate within each
  round; the tables are truncated before each cell;
- ``listener``: the listener's client CPU per notification received (asyncpg), at a given rate,
  with one LISTEN on the shared channel (outbox in the payload) against N LISTENs on one
  connection (a channel per outbox), idle CPU subtracted;
- ``dedup``: how many notifications a transaction touching several outboxes delivers under each
  variant (PostgreSQL folds identical channel+payload pairs within a transaction);
- ``poll``: one fallback-poll statement over all N outboxes (a UNION ALL of each outbox's
  ``poll`` query, and a lighter EXISTS form): plan and execution time, and round trip.

Usage (a superuser DSN; the script creates the database and ``drop`` drops it)::

    NOTIFY_OUTBOX_TEST_DSN=postgresql://... PYTHONPATH=. .venv/bin/python \\
        scripts/many_outboxes_notify.py setup --n 200
    ... producers --writers 16,4 --seconds 5 --rounds 3
    ... listener --rate 1000 --seconds 10
    ... dedup
    ... poll
    ... drop
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from notify_outbox.core.names import OutboxNames
from notify_outbox.pg.migrations import migrate

SHIPPED_CALL = "pg_notify('notify_outbox', '')"
VARIANTS = ("shared", "per_channel", "payload", "none")
MODES = ("always", "gated")


def _dsn(db: str) -> str:
    base = os.environ["NOTIFY_OUTBOX_TEST_DSN"]
    parts = urlsplit(base)
    return urlunsplit(parts._replace(path=f"/{db}"))


def _schemas(n: int) -> list[str]:
    return [f"t{i:03d}" for i in range(n)]


async def _count_outboxes(conn: asyncpg.Connection) -> int:
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.relname = 'outbox_config' AND n.nspname ~ '^t[0-9]{3}$'"
        )
    )


async def setup(db: str, n: int) -> None:
    admin = await asyncpg.connect(_dsn("postgres"))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{db}"')
    finally:
        await admin.close()
    conn = await asyncpg.connect(_dsn(db))
    try:
        started = time.monotonic()
        for schema in _schemas(n):
            await migrate(conn, OutboxNames(schema=schema))
        print(f"migrated {n} outboxes in {time.monotonic() - started:.1f} s")
    finally:
        await conn.close()


async def _set_variant(conn: asyncpg.Connection, n: int, variant: str, mode: str) -> None:
    """Rewrite every outbox's notify function for ``variant`` (from the shipped definition)."""
    for schema in _schemas(n):
        fn = f"{schema}.outbox_notify()"
        shipped = await conn.fetchval(
            "SELECT pg_get_functiondef($1::regprocedure)",
            fn,
        )
        body = re.sub(r"pg_notify\('[a-z0-9_]*', '[a-z0-9_.]*'\)", SHIPPED_CALL, shipped)
        assert SHIPPED_CALL in body, f"{fn}: the shipped pg_notify call was not found"
        if variant == "per_channel":
            body = body.replace(SHIPPED_CALL, f"pg_notify('notify_outbox_{schema}', '')")
        elif variant == "payload":
            body = body.replace(SHIPPED_CALL, f"pg_notify('notify_outbox', '{schema}.outbox')")
        await conn.execute(body)
        enable = "DISABLE" if variant == "none" else "ENABLE"
        await conn.execute(f"ALTER TABLE {schema}.outbox {enable} TRIGGER outbox_notify")
        await conn.execute(f"UPDATE {schema}.outbox_config SET notify_mode = '{mode}'")


async def _truncate(conn: asyncpg.Connection, n: int) -> None:
    await conn.execute("TRUNCATE " + ", ".join(f"{s}.outbox" for s in _schemas(n)))
    await conn.execute("CHECKPOINT")


def _pgbench(db: str, files: list[str], writers: int, seconds: int) -> float:
    cmd = ["pgbench", "-n", "-M", "prepared", "-c", str(writers), "-j", "2", "-T", str(seconds)]
    for f in files:
        cmd += ["-f", f]
    cmd.append(_dsn(db))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pgbench failed: {done.stderr[-2000:]}")
    out = done.stdout
    m = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out)
    assert m, out
    return float(m.group(1))


async def producers(
    db: str,
    n: int,
    writers: list[int],
    seconds: int,
    rounds: int,
    variants: list[str],
    modes: list[str],
) -> None:
    cells = [(v, m) for v in variants for m in modes if not (v == "none" and m == "gated")]
    if "none" in variants and "always" not in modes:
        cells.append(("none", "always"))
    results: dict[str, list[float]] = {}
    conn = await asyncpg.connect(_dsn(db))
    with tempfile.TemporaryDirectory() as tmp:
        # One script (pgbench takes at most 128): a random outbox, then its INSERT, chosen by
        # a chain of \\if (pgbench has no string formatting for the schema's name).
        lines = ["\\set k random(1, 2000000000)", f"\\set s random(0, {n - 1})"]
        for i, schema in enumerate(_schemas(n)):
            lines.append(("\\if" if i == 0 else "\\elif") + f" :s = {i}")
            lines.append(
                f"INSERT INTO {schema}.outbox (topic, key, payload) "
                "VALUES ('orders', :client_id || '-' || :k, '{}');"
            )
        lines.append("\\endif")
        path = Path(tmp) / "insert.sql"
        path.write_text("\n".join(lines) + "\n")
        files = [str(path)]
        try:
            for r in range(rounds):
                # Alternate: each round starts one cell further along, and reverses every other.
                order = cells[r % len(cells) :] + cells[: r % len(cells)]
                if r % 2:
                    order.reverse()
                for w in writers:
                    for variant, mode in order:
                        await _set_variant(conn, n, variant, mode)
                        await _truncate(conn, n)
                        load = os.getloadavg()[0]
                        tps = _pgbench(db, files, w, seconds)
                        key = f"{variant}/{mode}/w{w}"
                        results.setdefault(key, []).append(tps)
                        print(
                            f"round {r + 1} {key}: {tps:,.0f} commits/s (load {load:.2f})",
                            flush=True,
                        )
        finally:
            await _set_variant(conn, n, "shared", "gated")
            await conn.close()
    print("medians:")
    for key, values in sorted(results.items()):
        print(f"  {key}: {statistics.median(values):,.0f}  rounds {[round(v) for v in values]}")
    print(json.dumps({"nproc": os.cpu_count(), "results": results}))


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _listen_child(db: str, n: int, shape: str, seconds: float) -> None:
    """Listen as the relay would, dispatching each notification to its outbox's doorbell."""
    conn = await asyncpg.connect(_dsn(db))
    doorbells: dict[str, int] = dict.fromkeys(_schemas(n), 0)
    received = 0

    def on_payload(_c: object, _pid: int, _channel: str, payload: str) -> None:
        nonlocal received
        received += 1
        doorbells[payload.partition(".")[0]] += 1

    def on_channel(_c: object, _pid: int, channel: str, _payload: str) -> None:
        nonlocal received
        received += 1
        doorbells[channel.removeprefix("notify_outbox_")] += 1

    if shape == "shared":
        await conn.add_listener("notify_outbox", on_payload)
    else:
        for schema in _schemas(n):
            await conn.add_listener(f"notify_outbox_{schema}", on_channel)
    print("ready", flush=True)
    c0, t0 = _cpu(), time.monotonic()
    await asyncio.sleep(seconds)
    cpu = _cpu() - c0
    print(json.dumps({"received": received, "cpu": cpu, "wall": time.monotonic() - t0}))
    await conn.close()


async def _spawn_listener(
    db: str, n: int, shape: str, seconds: float, send: Callable[[], Awaitable[None]] | None
) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--db",
        db,
        "--n",
        str(n),
        "listen-child",
        "--shape",
        shape,
        "--seconds",
        str(seconds),
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert (await proc.stdout.readline()).strip() == b"ready"
    if send is not None:
        await send()
    out = await proc.stdout.read()
    await proc.wait()
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def listener(db: str, n: int, rate: int, seconds: float, rounds: int) -> None:
    sender = await asyncpg.connect(_dsn(db))
    per_tick = max(1, rate // 100)  # every 10 ms
    schemas = _schemas(n)

    def sender_for(shape: str) -> Callable[[], Awaitable[None]]:
        async def send() -> None:
            start, i, sent = time.monotonic(), 0, 0
            while sent < rate * seconds:
                batch = [schemas[(i + j) % n] for j in range(per_tick)]
                i += per_tick
                if shape == "shared":
                    channels = ["notify_outbox"] * len(batch)
                    payloads = [f"{s}.outbox" for s in batch]
                else:
                    channels = [f"notify_outbox_{s}" for s in batch]
                    payloads = [""] * len(batch)
                await sender.execute(
                    "SELECT pg_notify(c, p) FROM unnest($1::text[], $2::text[]) AS u(c, p)",
                    channels,
                    payloads,
                )
                sent += len(batch)
                delay = start + (sent / rate) - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)

        return send

    out: dict[str, list[float]] = {}
    for r in range(rounds):
        for shape in ("shared", "per_channel") if r % 2 == 0 else ("per_channel", "shared"):
            idle = await _spawn_listener(db, n, shape, seconds, None)
            busy = await _spawn_listener(db, n, shape, seconds + 1, sender_for(shape))
            per_ev = (busy["cpu"] - idle["cpu"] * (seconds + 1) / seconds) / busy["received"]
            out.setdefault(shape, []).append(per_ev * 1e6)
            print(
                f"round {r + 1} {shape}: received {busy['received']}, busy CPU "
                f"{busy['cpu']:.3f} s, idle CPU {idle['cpu']:.3f} s, "
                f"{per_ev * 1e6:.1f} us/notification (idle subtracted)",
                flush=True,
            )
    await sender.close()
    for shape, values in out.items():
        print(f"  {shape}: median {statistics.median(values):.1f} us/notification")


async def dedup(db: str, n: int, transactions: int) -> None:
    """Transactions each with 2 INSERT statements into each of 3 outboxes (mode always)."""
    conn = await asyncpg.connect(_dsn(db))
    for variant in ("shared", "per_channel", "payload"):
        await _set_variant(conn, n, variant, "always")
        got: list[tuple[str, str]] = []
        lconn = await asyncpg.connect(_dsn(db))

        def cb(
            _c: object, _pid: int, channel: str, payload: str, got: list[tuple[str, str]] = got
        ) -> None:
            got.append((channel, payload))

        await lconn.add_listener("notify_outbox", cb)
        for s in _schemas(n)[:3]:
            await lconn.add_listener(f"notify_outbox_{s}", cb)
        for t in range(transactions):
            async with conn.transaction():
                for s in _schemas(n)[:3]:
                    for j in range(2):
                        await conn.execute(
                            f"INSERT INTO {s}.outbox (topic, key, payload) "
                            "VALUES ('orders', $1, '{}')",
                            f"d{t}-{j}",
                        )
        await asyncio.sleep(0.5)
        await lconn.close()
        print(
            f"{variant}: {transactions} transactions x 3 outboxes x 2 statements -> "
            f"{len(got)} notifications ({len(set(got))} distinct channel/payload)"
        )
    await _set_variant(conn, n, "shared", "gated")
    await _truncate(conn, n)
    await conn.close()


# Every migrated outbox of the database, from the catalog alone: a table T in schema S with
# S.T_config beside it and S.T_claim of migration 0006, and T's notify trigger.
DISCOVERY = """
SELECT n.nspname AS schema, t.relname AS "table"
FROM pg_class t
JOIN pg_namespace n ON n.oid = t.relnamespace
JOIN pg_class c ON c.relnamespace = t.relnamespace AND c.relname = t.relname || '_config'
WHERE t.relkind = 'r'
  AND EXISTS (SELECT FROM pg_trigger g
              WHERE g.tgrelid = t.oid AND g.tgname = t.relname || '_notify')
  AND EXISTS (SELECT FROM pg_proc p
              WHERE p.pronamespace = t.relnamespace AND p.proname = t.relname || '_claim'
                AND p.pronargs = 5)
ORDER BY 1, 2
"""


async def poll(db: str, n: int, repeat: int) -> None:
    conn = await asyncpg.connect(_dsn(db))
    parts: list[str] = []
    args: list[Any] = []
    for i, s in enumerate(_schemas(n)):
        a = 3 * i
        parts.append(
            f"SELECT {i} AS o, {s}.outbox_due(${a + 1}::bigint, ${a + 2}::bigint[], "
            f"${a + 3}::bigint[]) AS due, "
            f"(SELECT extract(epoch FROM min(next_attempt_at) - now())::float8 FROM {s}.outbox "
            "WHERE published_at IS NULL AND next_attempt_at > now() "
            "AND next_attempt_at < 'infinity') AS retry_in, "
            f"EXISTS (SELECT FROM {s}.outbox_stuck()) AS stuck"
        )
        args += [1, [], []]
    full = (
        "SELECT * FROM ("
        + "\nUNION ALL\n".join(parts)
        + ") AS p WHERE due OR stuck OR retry_in IS NOT NULL"
    )
    light = (
        "SELECT o FROM ("
        + "\nUNION ALL\n".join(
            f"SELECT {i} AS o WHERE EXISTS (SELECT 1 FROM {s}.outbox WHERE published_at IS NULL)"
            for i, s in enumerate(_schemas(n))
        )
        + ") AS p"
    )
    one = "SELECT t000.outbox_due($1, $2, $3)"
    cases: list[tuple[str, str, list[Any]]] = [
        ("full", full, args),
        ("light", light, []),
        ("one outbox", one, [1, [], []]),
        ("discovery", DISCOVERY, []),
    ]
    found = await conn.fetch(DISCOVERY)
    print(f"discovery finds {len(found)} outboxes, e.g. {[tuple(r) for r in found[:2]]}")
    for name, sql, params in cases:
        plan = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", *params)
        doc = json.loads(plan)[0] if isinstance(plan, str) else plan[0]
        stmt = await conn.prepare(sql)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            await stmt.fetch(*params)
            times.append(time.perf_counter() - t0)
        print(
            f"{name}: EXPLAIN ANALYZE planning {doc['Planning Time']:.2f} ms, execution "
            f"{doc['Execution Time']:.2f} ms; prepared round trip median "
            f"{statistics.median(times) * 1e3:.2f} ms, p90 "
            f"{sorted(times)[int(repeat * 0.9)] * 1e3:.2f} ms ({repeat} runs)",
            flush=True,
        )
    await conn.close()


async def drop(db: str) -> None:
    admin = await asyncpg.connect(_dsn("postgres"))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    finally:
        await admin.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", default="many_scratch")
    p.add_argument("--n", type=int, default=200, help="outboxes (schemas t000..)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup")
    pr = sub.add_parser("producers")
    pr.add_argument("--writers", default="16,4")
    pr.add_argument("--seconds", type=int, default=5)
    pr.add_argument("--rounds", type=int, default=3)
    pr.add_argument("--variants", default=",".join(VARIANTS))
    pr.add_argument("--modes", default=",".join(MODES))
    li = sub.add_parser("listener")
    li.add_argument("--rate", type=int, default=1000)
    li.add_argument("--seconds", type=float, default=10.0)
    li.add_argument("--rounds", type=int, default=3)
    lc = sub.add_parser("listen-child")
    lc.add_argument("--shape", choices=("shared", "per_channel"), required=True)
    lc.add_argument("--seconds", type=float, required=True)
    de = sub.add_parser("dedup")
    de.add_argument("--transactions", type=int, default=100)
    po = sub.add_parser("poll")
    po.add_argument("--repeat", type=int, default=200)
    sub.add_parser("drop")
    a = p.parse_args()
    print(f"nproc {os.cpu_count()}, load average {os.getloadavg()}", file=sys.stderr)
    if a.cmd == "setup":
        asyncio.run(setup(a.db, a.n))
    elif a.cmd == "producers":
        ws = [int(w) for w in a.writers.split(",")]
        vs, ms = a.variants.split(","), a.modes.split(",")
        asyncio.run(producers(a.db, a.n, ws, a.seconds, a.rounds, vs, ms))
    elif a.cmd == "listener":
        asyncio.run(listener(a.db, a.n, a.rate, a.seconds, a.rounds))
    elif a.cmd == "listen-child":
        asyncio.run(_listen_child(a.db, a.n, a.shape, a.seconds))
    elif a.cmd == "dedup":
        asyncio.run(dedup(a.db, a.n, a.transactions))
    elif a.cmd == "poll":
        asyncio.run(poll(a.db, a.n, a.repeat))
    else:
        asyncio.run(drop(a.db))


if __name__ == "__main__":
    main()
