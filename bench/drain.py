"""The backlog-drain phase (``python -m bench drain``): how fast does a mode empty an outbox
that filled up while nothing was relaying? Rows inserted with the mode stopped, then the tally
consumer (``bench/tally.py``) and the mode's processes start at once. Method:
``bench/README.md``, "Backlog drain"."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from bench import envinfo
from bench.analysis import median
from bench.config import (
    POLLER,
    Mode,
    PhaseConfig,
    add_options,
    common_options,
    from_args,
    phase_options,
)
from bench.drain_schema import DRAIN_AVRO_SCHEMA
from bench.fmt import environment_lines, finish, mode_bullets, num, profile_lines, table, whole
from bench.phase import READY_TIMEOUT, PhaseRun, loadavg, slug, utc
from bench.pooler import needs_pgbouncer
from bench.procs import BenchError, Child
from bench.profile import start_profiler, stop_profiler, top_self
from bench.regimes import Cells, Regime
from bench.revs import with_alt_modes
from bench.services import Services, connection
from devstack._common import StackError
from devstack.schema_registry import APICURIO_VERSION, SchemaRegistryServer

# The SQL expression of each mix's key for row ``g`` (1-based). ``hot`` draws from random()
# after a fixed setseed(), so every cell of a run gets the same interleaving.
MIXES: dict[str, tuple[str, str]] = {
    "keys-1000": ("1,000 distinct keys, round robin", "'k' || (g % 1000)"),
    "keys-100000": ("100,000 distinct keys, round robin", "'k' || (g % 100000)"),
    "hot": (
        "half the rows on 10 hot keys, half over 100,000 keys, randomly interleaved",
        "CASE WHEN random() < 0.5 THEN 'h' || floor(random() * 10)::int "
        "ELSE 'k' || floor(random() * 100000)::int END",
    ),
    "null": ("NULL keys", "NULL::text"),
}
DEFAULT_MIXES = ("keys-1000", "keys-100000", "hot", "null")
DEFAULT_MODES = ("relay-1", "relay-2", "relay-4", "poller")

# The ordering trigger takes one advisory lock per distinct key and transaction: 100,000 keys
# in one transaction would overflow the shared lock table (max_locks_per_transaction x
# max_connections), so the backlog goes in as chunks, each its own committed transaction.
_CHUNK = 5000
_PAYLOAD_BYTES = 200
# The JSON text of a payload without its digits and padding: {"g": , "p": "", "s": }
_PAYLOAD_OVERHEAD = 23
_QUERY_TIMEOUT = 300.0  # a 100,000-row chunked insert or VACUUM on a busy 2-core machine
_EMPTY_TIMEOUT = 30.0
_MODE_RE = re.compile(r"^relay-(\d+)(-alt)?(-pgbouncer)?(-avro)?(-eos)?$")
_REGISTRY_URL = "NOTIFY_OUTBOX_SCHEMA_REGISTRY_URL"


@dataclass(frozen=True)
class DrainMode:
    """A mode of the drain phase: ``processes`` processes of ``mode``, started at once."""

    name: str
    mode: Mode
    processes: int
    # The relay encodes values as Avro with the subject <topic>-value's schema, which the
    # bench registers per cell: the registry's URL is known only once the run started it.
    avro: bool = False

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready description."""
        return {
            "name": self.name,
            "processes": self.processes,
            "avro": self.avro,
            **self.mode.to_json(),
        }


def parse_mode(name: str, alt_tree: str | None) -> DrainMode:
    """``relay-N`` (N relay processes), ``relay-N-alt`` (from ``--alt-relay``), either
    with ``-pgbouncer`` and then ``-avro``, or ``poller``."""
    if name == "poller":
        return DrainMode(name, POLLER, 1)
    m = _MODE_RE.match(name)
    if m is None or int(m.group(1)) < 1:
        raise BenchError(
            f"unknown drain mode {name!r}: relay-N, relay-N-alt, relay-N[-alt]-pgbouncer, "
            "relay-N[-alt][-pgbouncer]-avro, relay-N[-pgbouncer][-avro]-eos or poller"
        )
    n, alt, pooled, avro = int(m.group(1)), bool(m.group(2)), bool(m.group(3)), bool(m.group(4))
    eos = bool(m.group(5))
    if alt and alt_tree is None:
        raise BenchError(f"mode {name} needs --alt-relay DIR")
    where = f"; relay code from {alt_tree}" if alt else ""
    if pooled:
        where += (
            "; workers through a transaction-pooling PgBouncer (no statement cache), the "
            "listening connection direct (NOTIFY_OUTBOX_LISTEN_DSN)"
        )
    if avro:
        where += (
            "; values encoded as Avro in Confluent's wire format through the run's Schema "
            f"Registry (Apicurio {APICURIO_VERSION}, {_REGISTRY_URL}), subject <topic>-value"
        )
    if eos:
        where += "; exactly-once delivery (Kafka transactions, the tally reads read_committed)"
    mode = Mode(
        name,
        "relay",
        f"{n} notify-outbox relay process(es), default settings, NOTIFY trigger as migrated{where}",
        cwd=alt_tree if alt else None,
        pgbouncer=pooled,
        listen_direct=pooled,
        env=(("NOTIFY_OUTBOX_DELIVERY", "exactly-once"),) if eos else (),
        delivery="exactly-once" if eos else "at-least-once",
    )
    return DrainMode(name, mode, n, avro=avro)


def alt_drain_mode(name: str) -> str | None:
    """The ``-alt`` counterpart of a ``relay-N[-pgbouncer][-avro]`` mode (None for the
    others)."""
    m = _MODE_RE.match(name)
    if m is None or m.group(2) or m.group(5):  # older builds have no exactly-once mode
        return None
    return f"relay-{m.group(1)}-alt{m.group(3) or ''}{m.group(4) or ''}"


def mode_env(dm: DrainMode, relay_env: dict[str, str], registry_url: str | None) -> dict[str, str]:
    """The extra environment of ``dm``'s processes: ``--relay-env`` for a relay, plus the
    registry's URL for an ``-avro`` mode (merged: the other settings still apply)."""
    if dm.mode.kind != "relay":
        return {}
    if not dm.avro:
        return relay_env
    if registry_url is None:
        raise BenchError(f"mode {dm.name} needs the run's Schema Registry, which is not running")
    return {**relay_env, _REGISTRY_URL: registry_url}


@dataclass
class DrainConfig(PhaseConfig):
    """Everything one drain run does; recorded in the result JSON."""

    rows: int = 100_000
    mixes: list[str] = field(default_factory=lambda: list(DEFAULT_MIXES))
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    repeat: int = 1
    cell_timeout: float = 0.0  # 0: 60 s + 1 s per 500 rows
    profile: bool = False  # py-spy the first process of each mode in the first round

    def timeout(self) -> float:
        """Seconds a cell may take from the mode's start to the last arrival."""
        return self.cell_timeout or 60.0 + self.rows / 500.0


HELP = "backlog drain: events/s emptying a pre-filled outbox"


def arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m bench drain``."""
    p.add_argument("--mixes", nargs="+", help="key mixes (default: keys-1000 keys-100000 hot null)")
    p.add_argument(
        "--modes",
        nargs="+",
        help="relay-N (N relay processes), relay-N-alt (with --alt-relay), "
        "relay-N[-alt]-pgbouncer (through a transaction-pooling PgBouncer), any relay mode "
        "with -avro last (values as Avro through a Schema Registry the run starts), poller "
        "(default: relay-1 relay-2 relay-4 poller)",
    )
    add_options(
        p,
        DrainConfig,
        rows="rows per cell (default 100000)",
        repeat="rounds (modes interleaved; medians)",
        cell_timeout=("seconds (default 60 + rows/500)", {"default": None}),
        profile="py-spy the first process of each mode in the first round; the report lists "
        "the functions with the most own time",
    )
    phase_options(p)


def configure(args: argparse.Namespace) -> DrainConfig:
    """The config of ``python -m bench drain ...`` (a BenchError for a bad value)."""
    common = common_options(args)
    mixes = list(dict.fromkeys(args.mixes or DEFAULT_MIXES))
    unknown = [m for m in mixes if m not in MIXES]
    if unknown:
        raise BenchError(f"unknown key mix(es) {unknown}; known: {sorted(MIXES)}")
    modes = list(dict.fromkeys(args.modes or DEFAULT_MODES))
    if args.alt_revision:
        modes = with_alt_modes(modes, alt_drain_mode)
    for m in modes:
        parse_mode(m, common["alt_relay"])  # fails early on a bad name
    if args.rows < 1 or args.repeat < 1:
        raise BenchError("--rows and --repeat must be at least 1")
    return from_args(
        DrainConfig, args, mixes=mixes, modes=modes, cell_timeout=args.cell_timeout or 0.0, **common
    )


async def fill_backlog(dsn: str, topic: str, mix: str, rows: int) -> dict[str, float]:
    """Insert ``rows`` committed rows of key mix ``mix`` (payloads of ~200 bytes carrying
    ``s``, the row's sequence number within its key), then ``VACUUM ANALYZE`` the outbox."""
    key_sql = MIXES[mix][1]
    async with connection(dsn) as conn:
        t0 = time.monotonic()
        await conn.execute("SELECT setseed(0.42)")
        # A staging table first: the per-key sequence numbers need a window over all rows,
        # while the insert itself goes in chunks (see _CHUNK).
        await conn.execute(
            "CREATE UNLOGGED TABLE bench_backlog AS "
            "SELECT g, key, (row_number() OVER (PARTITION BY key ORDER BY g))::int AS s "
            f"FROM (SELECT g, {key_sql} AS key FROM generate_series(1, $1::int) AS g) AS t",
            rows,
            timeout=_QUERY_TIMEOUT,
        )
        for lo in range(0, rows, _CHUNK):
            # ORDER BY g: the ordering trigger draws ids in this order, so within a key ids
            # (claim order) and "s" (the consumer's order check) agree.
            await conn.execute(
                "INSERT INTO outbox (topic, key, payload) "
                "SELECT $1, key, jsonb_build_object('g', g, 's', s, 'p', repeat('x', "
                f"greatest(0, {_PAYLOAD_BYTES - _PAYLOAD_OVERHEAD} - length(g::text) "
                "- length(s::text)))) "
                "FROM bench_backlog WHERE g > $2 AND g <= $3 ORDER BY g",
                topic,
                lo,
                lo + _CHUNK,
                timeout=_QUERY_TIMEOUT,
            )
        await conn.execute("DROP TABLE bench_backlog")
        inserted = time.monotonic() - t0
        await conn.execute("VACUUM ANALYZE outbox", timeout=_QUERY_TIMEOUT)
        vacuumed = time.monotonic() - t0 - inserted
        count = int(await conn.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL"))
        if count != rows:
            raise BenchError(f"backlog of {mix}: {count} pending rows instead of {rows}")
        size = await conn.fetchval("SELECT avg(length(payload::text))::float FROM outbox")
    return {"insert_s": inserted, "vacuum_s": vacuumed, "payload_bytes": float(size or 0)}


async def _pending(conn: asyncpg.Connection) -> int:
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL", timeout=_QUERY_TIMEOUT
        )
    )


async def _wait_empty(dsn: str) -> int:
    """Wait (bounded) until no row is pending: a mode marks or deletes a batch only after
    Kafka acknowledged it, so the consumer can see the last event a moment earlier."""
    async with connection(dsn) as conn:
        deadline = time.monotonic() + _EMPTY_TIMEOUT
        left = await _pending(conn)
        while left and time.monotonic() < deadline:
            # Nothing signals "marked": polling the count is the only way to see it.
            await asyncio.sleep(0.1)
            left = await _pending(conn)
        return left


class _Drain(Cells[DrainMode]):
    name, short = "drain", "drain"
    cfg: DrainConfig

    def __init__(self, cfg: DrainConfig, run: PhaseRun) -> None:
        super().__init__(cfg, run, [parse_mode(m, cfg.alt_relay) for m in cfg.modes])
        run.result["mixes"] = {m: MIXES[m][0] for m in cfg.mixes}
        self.registry_url: str | None = None

    def intro(self) -> str:
        cfg = self.cfg
        return (
            f"drain: {cfg.rows} rows x {len(cfg.mixes)} mix(es) x {len(self.modes)} mode(s) x "
            f"{cfg.repeat} round(s), cell timeout {cfg.timeout():.0f}s"
        )

    def pgbouncer(self) -> bool:
        return needs_pgbouncer(m.mode for m in self.modes.values())

    def grid(self) -> Iterator[tuple[dict[str, Any], str]]:
        for rnd in range(self.cfg.repeat):
            for mix in self.cfg.mixes:
                for dm in self.modes.values():
                    identity = {"round": rnd, "mix": mix, "mode": dm.name}
                    identity |= {"processes": dm.processes, "rows": self.cfg.rows}
                    yield identity, f"{mix} {dm.name} round {rnd + 1}"

    async def body(self, services: Services) -> None:
        if not any(m.avro for m in self.modes.values()):
            await super().body(services)
            return
        # One registry for the whole run (a JVM: ~5 s to start), in the run's work directory,
        # so that no cell pays for its start-up; it idles through the JSON modes' cells too.
        registry = SchemaRegistryServer(self.run.work / "schema-registry")
        self.run.progress.status(f"starting the Schema Registry (Apicurio {APICURIO_VERSION})")
        try:
            try:
                await asyncio.to_thread(registry.start)
            except StackError as e:
                raise BenchError(f"the Schema Registry did not start: {e}") from None
            self.registry_url = registry.url
            self.run.result["schema_registry"] = {
                "server": f"Apicurio Registry {APICURIO_VERSION}",
                "url": registry.url,
                "schema": DRAIN_AVRO_SCHEMA,
            }
            await super().body(services)
        finally:
            self.registry_url = None
            try:
                await asyncio.to_thread(registry.stop)
            except Exception as e:  # reported, without hiding what the rounds raised
                self.run.errors.append(f"stopping the Schema Registry: {type(e).__name__}: {e}")

    async def cell(
        self, services: Services, identity: dict[str, Any], label: str
    ) -> dict[str, Any]:
        run, cfg = self.run, self.cfg
        dm = self.modes[identity["mode"]]
        cell: dict[str, Any] = {"cell": len(self.cells) + 1, **identity, "started_utc": utc()}
        topic = self.names(cell)[1]
        run.progress.status(f"{label}: database, topic, {cfg.rows} rows")

        async def measure(dsn: str) -> None:
            cell.update(await fill_backlog(dsn, topic, cell["mix"], cfg.rows))
            if dm.avro:
                # Before the relay starts: a governed topic without a schema fails its rows.
                cell["schema_id"] = await self._register(topic)
            await self._measure(services, dsn, topic, dm, cell, label)

        await self.in_fresh_database(services, dm.mode, cell, measure)
        rate = cell.get("rate_first_last")
        run.progress.line(
            f"{label:<34} "
            + (
                f"{rate:8.0f} ev/s first->last, {cell['rate_from_start']:8.0f} from start, "
                f"first after {cell['first_after_start_s']:.2f}s"
                if rate is not None
                else "no rate"
            )
            + f" | {cell['unique']}/{cfg.rows} arrived, {cell['order_violations']} order "
            f"violations, {cell['pending_after']} pending"
            + (" TIMED OUT" if cell["timed_out"] else ""),
            cell=True,
        )
        return cell

    async def _register(self, topic: str) -> int:
        """Register the drain payloads' Avro schema under ``<topic>-value``; its id."""
        from notify_outbox.schemaregistry import RegistryClient, RegistryError

        assert self.registry_url is not None
        client = RegistryClient(self.registry_url)
        try:
            return await client.register(f"{topic}-value", json.dumps(DRAIN_AVRO_SCHEMA))
        except RegistryError as e:
            raise BenchError(f"registering the schema of {topic}: {e}") from None
        finally:
            await client.aclose()

    async def _measure(
        self,
        services: Services,
        dsn: str,
        topic: str,
        dm: DrainMode,
        cell: dict[str, Any],
        label: str,
    ) -> None:
        run, cfg = self.run, self.cfg
        tally = await run.start_helper(
            f"tally {label}", "_tally", services.bootstrap, topic, log=f"tally-{slug(label)}"
        )
        procs: list[Child] = []
        profiler: asyncio.subprocess.Process | None = None
        raw = run.out_dir
        try:
            ready = json.loads(await tally.read_line(READY_TIMEOUT))
            if not ready.get("ready"):
                raise BenchError(f"tally consumer of {label} did not get ready: {ready}")
            extra = mode_env(dm, cfg.relay_env, self.registry_url)
            host0 = envinfo.cpu_times()
            run.progress.status(f"{label}: draining")
            t_start = time.monotonic_ns()
            names = [f"{dm.name}-{i + 1}-{slug(label)}" for i in range(dm.processes)]
            await run.start_all(services, dm.mode, dsn, names, procs, extra)
            t_ready = time.monotonic_ns()
            # The CPU of starting up (imports, connecting: about 0.5 s) is no part of the
            # drain's cost per event; rows are claimed only from readiness on.
            cpu_ready = sum(p.cpu() for p in procs)
            if cfg.profile and cell["round"] == 0:
                raw = run.out_dir / f"drain-{run.run_id}-profile-{slug(cell['mix'])}-{dm.name}.txt"
                profiler = await start_profiler(procs[0].pid, raw)
            timeout = max(1.0, cfg.timeout() - (t_ready - t_start) / 1e9)
            await tally.send_line(
                json.dumps({"cmd": "wait", "expect": cfg.rows, "timeout": timeout})
            )
            got = json.loads(await tally.read_line(timeout + 30))
            cpu = sum(p.cpu() for p in procs)
            host1 = envinfo.cpu_times()
            if profiler is not None:
                await stop_profiler(profiler)
                profiler = None
                cell["profile"] = {"file": raw.name, **top_self(raw)}
            pending = await _wait_empty(dsn)
        finally:
            if profiler is not None:
                await stop_profiler(profiler)
            codes = [await run.stop(p) for p in procs]
            with contextlib.suppress(Exception):
                await tally.send_line(json.dumps({"cmd": "quit"}))
            await tally.stop(15)
        first, last = got.get("first_ns"), got.get("last_ns")
        unique = int(got["unique"])
        cell.update(
            {
                "timed_out": not got["complete"],
                "unique": unique,
                "records": got["records"],
                "duplicates": got["duplicates"],
                "no_event_id": got["no_event_id"],
                "order_violations": got["order_violations"],
                "keyed": got["keyed"],
                "keys": got["keys"],
                "keyed_without_seq": got["keyed_without_seq"],
                "avro_records": got.get("avro_records", 0),
                "ready_after_start_s": (t_ready - t_start) / 1e9,
                "first_after_start_s": (first - t_start) / 1e9 if first else None,
                "drain_s": (last - first) / 1e9 if first and last else None,
                "total_s": (last - t_start) / 1e9 if last else None,
                "rate_first_last": (
                    (unique - 1) / ((last - first) / 1e9)
                    if first and last and last > first and got["complete"]
                    else None
                ),
                "rate_from_start": (
                    unique / ((last - t_start) / 1e9) if last and got["complete"] else None
                ),
                "pending_after": pending,
                "mode_cpu_s": round(cpu, 3),
                "mode_cpu_us_per_event": round(1e6 * cpu / unique, 1) if unique else None,
                "mode_cpu_drain_us_per_event": (
                    round(1e6 * (cpu - cpu_ready) / unique, 1) if unique else None
                ),
                "host_cpu_busy": envinfo.busy_share(host0, host1),
                "load_average": loadavg(),
                "exit_codes": codes,
                "relay_env": extra,
            }
        )


def problems(result: dict[str, Any]) -> list[str]:
    """What makes a drain result wrong (not slow): a cell that timed out, lost events, broke
    per-key order or left rows pending."""
    problems = []
    for c in result.get("cells", []):
        where = f"cell {c['cell']} ({c['mix']}, {c['mode']}, round {c['round'] + 1})"
        if c.get("timed_out", True):
            problems.append(f"{where}: timed out, {c.get('unique', 0)} of {c['rows']} arrived")
        elif c["unique"] != c["rows"]:
            problems.append(f"{where}: {c['unique']} of {c['rows']} arrived")
        if c.get("order_violations"):
            problems.append(f"{where}: {c['order_violations']} per-key order violations")
        if c.get("keyed_without_seq"):
            problems.append(f"{where}: {c['keyed_without_seq']} keyed events without a sequence")
        if c.get("pending_after"):
            problems.append(f"{where}: {c['pending_after']} rows still pending")
        m = _MODE_RE.match(c["mode"])
        avro = bool(m and m.group(4)) and not c.get("timed_out", True)
        if avro and c.get("avro_records") != c.get("unique"):
            # Some records went out as JSON: the cell did not measure what its mode says.
            problems.append(
                f"{where}: {c.get('avro_records')} of {c.get('unique')} events Avro-encoded"
            )
    return problems


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds per (mix, mode), and the targets of issues 10 and 33 where they
    apply."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in result.get("cells", []):
        groups.setdefault((c["mix"], c["mode"]), []).append(c)

    def med(cells: list[dict[str, Any]], k: str) -> float | None:
        return median(c.get(k) for c in cells)

    rows: list[dict[str, Any]] = []
    for (mix, mode), cells in groups.items():
        rows.append(
            {
                "mix": mix,
                "mode": mode,
                "rounds": len(cells),
                "complete": sum(not c.get("timed_out", True) for c in cells),
                "rate_first_last": med(cells, "rate_first_last"),
                "rate_from_start": med(cells, "rate_from_start"),
                "first_after_start_s": med(cells, "first_after_start_s"),
                "rates": [c.get("rate_first_last") for c in cells],
                "order_violations": sum(int(c.get("order_violations") or 0) for c in cells),
                "lost": sum(int(c["rows"]) - int(c.get("unique") or 0) for c in cells),
                "duplicates": sum(int(c.get("duplicates") or 0) for c in cells),
                "pending_after": sum(int(c.get("pending_after") or 0) for c in cells),
                "mode_cpu_us_per_event": med(cells, "mode_cpu_us_per_event"),
                "mode_cpu_drain_us_per_event": med(cells, "mode_cpu_drain_us_per_event"),
            }
        )
    by: dict[tuple[str, str], float | None] = {
        (r["mix"], r["mode"]): r["rate_first_last"] for r in rows
    }
    targets: list[dict[str, Any]] = []
    modes = list(result["config"]["modes"])
    relays = [m for m in modes if m.startswith("relay-")]
    for relay in relays:
        for mix in result["config"]["mixes"]:
            if mix == "null":
                continue
            r, p, own = by.get((mix, relay)), by.get((mix, "poller")), by.get(("null", relay))
            if r is not None and p is not None:
                targets.append(_ratio_target(f"{relay}, {mix}: >= 2x the poller", r / p, 2.0))
            if r is not None and own is not None:
                targets.append(
                    _ratio_target(f"{relay}, {mix}: >= 0.8x its own NULL-key drain", r / own, 0.8)
                )
    for relay in relays:
        m = _MODE_RE.match(relay)
        if m is None or m.group(1) == "1":
            continue
        one = f"relay-1{''.join(g or '' for g in m.groups()[1:])}"
        for mix in result["config"]["mixes"]:
            r, base = by.get((mix, relay)), by.get((mix, one))
            if r is not None and base is not None:
                targets.append(
                    _ratio_target(f"{relay} vs {one}, {mix}: never slower", r / base, 1.0)
                )
    for relay in relays:
        m = _MODE_RE.match(relay)
        if m is None or not m.group(5):
            continue
        plain = relay.removesuffix("-eos")
        for mix in result["config"]["mixes"]:
            r, base = by.get((mix, relay)), by.get((mix, plain))
            if mix != "null" and r is not None and base is not None:  # issue 35: keyed
                targets.append(_ratio_target(f"{relay} vs {plain}, {mix}: >= 0.5x", r / base, 0.5))
    for relay in relays:
        m = _MODE_RE.match(relay)
        if m is None or not m.group(4):
            continue
        plain = relay.removesuffix("-avro")
        for mix in result["config"]["mixes"]:
            r, base = by.get((mix, relay)), by.get((mix, plain))
            # Issue 33 names the keyed drain: the NULL-key mix has no target of its own.
            if mix != "null" and r is not None and base is not None:
                targets.append(
                    _ratio_target(
                        f"{relay} vs {plain}, {mix}: >= 0.8x its JSON rate", r / base, 0.8
                    )
                )
    return {"rows": rows, "targets": targets}


def _ratio_target(what: str, ratio: float, need: float) -> dict[str, Any]:
    """One target row: ``ratio`` must be at least ``need``."""
    return {"target": what, "ratio": ratio, "verdict": "met" if ratio >= need else "MISSED"}


def markdown(result: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    cfg = result["config"]
    lines = [f"# notify-outbox backlog drain {result['run_id']}", ""]
    lines += environment_lines(result)
    env_bits = ", ".join(f"{k}={v}" for k, v in cfg.get("relay_env", {}).items())
    lines += [
        f"- {cfg['rows']:,} committed rows per cell (~200-byte JSON payloads; the `-avro` modes' "
        "relays send them as Avro records), inserted with "
        "the mode stopped, then `VACUUM ANALYZE`; a fresh database and a 3-partition topic per "
        f"cell; {cfg['repeat']} round(s), modes interleaved per round, medians over rounds"
        + (f"; relay settings: {env_bits}" if env_bits else ""),
        "",
        "Events/s from the consumer's first arrival to its last (the drain rate), from the "
        "mode's start, and seconds from the start to the first arrival.",
        "",
        "## Drain rate (events/s, first -> last arrival, median)",
        "",
    ]
    modes = list(cfg["modes"])
    by = {(r["mix"], r["mode"]): r for r in summary["rows"]}
    lines += table(
        ["key mix", *modes],
        [
            [
                mix,
                *(whole(by[(mix, m)]["rate_first_last"]) if (mix, m) in by else "-" for m in modes),
            ]
            for mix in cfg["mixes"]
        ],
    )
    if summary["targets"]:
        lines += ["", "## Targets (issues 10 and 33; ratios within this run)", ""]
        lines += table(
            "target | ratio | verdict",
            [[t["target"], f"{t['ratio']:.2f}x", t["verdict"]] for t in summary["targets"]],
        )
    lines += ["", "## Every mix and mode", ""]
    lines += table(
        (
            "mix | mode | rounds complete | ev/s first->last | ev/s from start | "
            "first arrival after start (s) | lost | duplicates | order violations | "
            "pending after | mode CPU µs/event | of it while draining | per round (ev/s)"
        ),
        [
            [
                r["mix"],
                r["mode"],
                f"{r['complete']}/{r['rounds']}",
                whole(r["rate_first_last"]),
                whole(r["rate_from_start"]),
                num(r["first_after_start_s"]),
                str(r["lost"]),
                str(r["duplicates"]),
                str(r["order_violations"]),
                str(r["pending_after"]),
                num(r["mode_cpu_us_per_event"], 0),
                num(r.get("mode_cpu_drain_us_per_event"), 1),
                " ".join(whole(v) for v in r["rates"]),
            ]
            for r in summary["rows"]
        ],
    )
    lines += _profile_lines(result)
    lines += ["", "## Key mixes and modes", ""]
    lines += [f"- `{m}`: {d}" for m, d in result.get("mixes", {}).items()]
    lines += mode_bullets(result)
    return finish(lines, result, plots, problems(result))


def _profile_lines(result: dict[str, Any]) -> list[str]:
    """Per profiled cell (``--profile``), the functions with the most own time."""
    lines: list[str] = []
    for c in result.get("cells", []):
        if c.get("profile"):
            lines += profile_lines(f"{c['mix']}, {c['mode']}", c["profile"])
    return lines


def plot(result: dict[str, Any], summary: dict[str, Any], path: Path) -> bool:
    from bench.plots import bar_figure, save_bar_chart  # matplotlib only when plotting

    mixes, modes = list(result["config"]["mixes"]), list(result["config"]["modes"])
    by = {(r["mix"], r["mode"]): r["rate_first_last"] for r in summary["rows"]}
    if not any(v for v in by.values()):
        return False
    fig, ax = bar_figure(max(6.0, 1.6 * len(mixes) * max(1, len(modes)) / 3))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        xs = [j + i * width for j in range(len(mixes))]
        ax.bar(xs, [by.get((mix, mode)) or 0 for mix in mixes], width, label=mode)
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(mixes))])
    ax.set_xticklabels(mixes)
    ax.set_ylabel("events/s, first -> last arrival (median)")
    ax.set_title(f"Backlog drain of {result['config']['rows']:,} rows")
    return save_bar_chart(fig, ax, path)


REGIME = Regime.of(__name__, _Drain.main)
