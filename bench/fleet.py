"""The fleet regime (``python -m bench fleet``, issue #34): one process serving every outbox
of a database (``NOTIFY_OUTBOX_OUTBOXES=*``) next to a relay process per outbox: what each
costs the database while idle, their latency at a light load spread over the outboxes, and
whether one outbox draining a backlog holds the others back. Method: ``bench/README.md``,
"Fleet"."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from bench.analysis import median
from bench.arrays import load_arrays
from bench.config import (
    PhaseConfig,
    add_options,
    common_options,
    from_args,
    phase_options,
    writers_for,
)
from bench.failing_head import quiet_record
from bench.fmt import (
    environment_lines,
    finish,
    grid,
    modes_section,
    num,
    targets_section,
    whole,
)
from bench.hist import Histogram
from bench.loadgen import LoadConfig
from bench.phase import READY_TIMEOUT, PhaseRun
from bench.procs import BenchError, Child
from bench.regimes import (
    CpuMeter,
    Regime,
    RegimeRun,
    add_cell,
    cell_record,
    database_postmaster,
    latency_ms,
    received_at,
    regime_mode,
    target,
    unfinished,
)
from bench.services import Services, connection, db_counters, dsn_for, statement_calls
from devstack.relayproc import READY, create_topics

_FLEET_READY = "fleet running"
_QUERY_TIMEOUT = 300.0  # a 100,000-row insert or VACUUM on a busy 2-core machine
_IDLE_TARGET = 0.3  # statements/s per database with every outbox idle (issue #34)
_FAIR_TARGET_MS = 20.0  # the others' p99 while one outbox drains a backlog (issue #34)


@dataclass
class FleetConfig(PhaseConfig):
    """Everything one fleet run does; recorded in the result JSON."""

    outboxes: int = 200
    databases: int = 1
    per_outbox_procs: int = 20
    repeat: int = 3
    settle: float = 15.0
    idle_window: float = 30.0
    rate: float = 100.0
    keys: int = 1000
    warmup: float = 2.0
    latency_seconds: float = 20.0
    backlog_rows: int = 100_000
    backlog_keys: int = 1000
    fairness_seconds: float = 30.0
    lead: float = 3.0
    held_backlog: float = 0.0
    drain_timeout: float = 300.0
    no_floor: bool = False
    fairness_only: bool = False
    split: bool = False
    quick: bool = False


# --quick: these, unless given on the command line.
_QUICK = {
    "repeat": 1,
    "settle": 11.0,
    "idle_window": 15.0,
    "latency_seconds": 10.0,
    "fairness_seconds": 15.0,
}

HELP = "one process serving 200 outboxes vs a process per outbox: idle cost, latency, fairness"


def arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m bench fleet``."""
    add_options(
        p,
        FleetConfig,
        outboxes="outboxes (schemas t000, t001, ...) in the database (default 200)",
        databases="databases the outboxes are spread over (round robin; default 1): the fleet "
        "serves them all from one process (a fleet file)",
        per_outbox_procs="relay processes of the per-outbox setup, one per outbox: idle "
        "figures are also scaled to --outboxes (default 20)",
        repeat="rounds (setups interleaved; medians)",
        settle="seconds after start-up before the idle window (PostgreSQL's delayed statistics)",
        idle_window="seconds of the idle window",
        rate="events/s of the latency and fairness cells (a random outbox per event)",
        warmup="seconds of a latency cell's load before it is measured",
        latency_seconds="measured seconds of a latency cell",
        backlog_rows="rows of the backlog one outbox drains in the fairness cell",
        backlog_keys="distinct keys of the backlog's rows",
        fairness_seconds="seconds of the other outboxes' events in a fairness cell (at least "
        "the drain)",
        drain_timeout="seconds the backlog may take to drain",
        lead="seconds the others' events flow in a fairness cell before it is measured and "
        "the backlog inserted (the fleet's sessions warm up meanwhile)",
        held_backlog="seconds the backlog waits unannounced after its commit (its outbox's "
        "notify off meanwhile, the relays' fallback polls 10 minutes apart) before a NOTIFY "
        "naming its outbox starts the drain, measured from that NOTIFY: the drain apart from "
        "the stall every commit of the database meets while the backlog's WAL is flushed "
        "(0: drained as it commits)",
        no_floor="leave out the Kafka floor cells",
        fairness_only="only the fairness cells (no idle, latency or floor cells)",
        split="also a control fairness cell: the backlog's outbox served by a relay process "
        "of its own, the fleet serving the others (is the fleet's sharing the cause, or the "
        "host?)",
        quick="one short round (about 4 minutes)",
    )
    phase_options(p)


def configure(args: argparse.Namespace) -> FleetConfig:
    """The config of ``python -m bench fleet ...`` (a BenchError for a bad value)."""
    cfg = from_args(FleetConfig, args, **common_options(args))
    if cfg.quick:
        defaults = {f.name: f.default for f in fields(FleetConfig)}
        for name, value in _QUICK.items():
            if getattr(args, name) == defaults[name]:
                setattr(cfg, name, value)
    if cfg.outboxes < 2 or not 1 <= cfg.per_outbox_procs <= cfg.outboxes:
        raise BenchError("--outboxes must be at least 2, --per-outbox-procs 1 to --outboxes")
    if not 1 <= cfg.databases <= cfg.outboxes:
        raise BenchError("--databases must be 1 to --outboxes")
    if cfg.repeat < 1 or cfg.rate <= 0 or cfg.backlog_rows < 0:
        raise BenchError("--repeat and --rate must be positive, --backlog-rows not negative")
    return cfg


def _schemas(n: int) -> list[str]:
    width = max(3, len(str(n - 1)))
    return [f"t{i:0{width}d}" for i in range(n)]


def _rss_mib(pid: int) -> float:
    """Resident memory of a process, MiB (0.0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _ack_recv(gen: dict[str, Any], got: dict[str, Any], since: int, until: int) -> dict[str, Any]:
    """Commit ack -> receipt of the events acked in [since, until) (monotonic ns)."""
    recv_of = received_at(got)
    acked = [(i, a) for i, a in enumerate(gen["ack"]) if since <= a < until]
    h = Histogram()
    h.record_ns([recv_of[i] - a for i, a in acked if i in recv_of])
    return {"acked": len(acked), "missing": len(acked) - h.count, **latency_ms(h)}


class _Fleet(RegimeRun):
    name = "fleet"
    cfg: FleetConfig

    def __init__(self, cfg: FleetConfig, run: PhaseRun) -> None:
        super().__init__(cfg, run)
        self.mode = regime_mode("notify", None)
        if cfg.alt_relay is not None:
            self.mode = self.mode.from_tree(cfg.alt_relay, "notify")
        self.schemas = _schemas(cfg.outboxes)
        base = f"bench_fleet_{run.run_id.lower()}"
        n = cfg.databases
        self.db_names = [base] if n == 1 else [f"{base}_{i}" for i in range(n)]
        self.database = self.db_names[0]
        self.db_of = {s: i % n for i, s in enumerate(self.schemas)}
        self.dsns: list[str] = []
        self.cells: list[dict[str, Any]] = []
        self.postmaster: int | None = None
        self.statements = False
        run.result["modes"] = {"notify": self.mode.to_json()}
        run.result["cells"] = self.cells
        setups = 0 if cfg.fairness_only else 2 + (not cfg.no_floor)
        fair = 1 + bool(cfg.backlog_rows) * (1 + cfg.split)
        run.progress.total = cfg.repeat * (setups + fair)

    def intro(self) -> str:
        cfg = self.cfg
        return (
            f"fleet: {cfg.outboxes} outboxes; one fleet process vs {cfg.per_outbox_procs} "
            f"per-outbox relays x {cfg.repeat} round(s): {cfg.idle_window:g}s idle, "
            f"{cfg.latency_seconds:g}s at {cfg.rate:g} ev/s; fairness: "
            f"{cfg.backlog_rows:,}-row backlog in one outbox"
        )

    async def body(self, services: Services) -> None:
        run, cfg = self.run, self.cfg
        self.statements = bool(run.result["environment"].get("pg_stat_statements"))
        if not self.statements:
            run.notes.append("no pg_stat_statements: statements/s are missing, see xacts/s")
        self.postmaster = await database_postmaster(services, run)
        try:
            dsn = await self._create(services)
            for rnd in range(cfg.repeat):
                kinds = ["fleet", "per-outbox"][:: 1 if rnd % 2 == 0 else -1]
                kinds += [] if cfg.no_floor else ["floor"]
                kinds = [] if cfg.fairness_only else kinds
                for kind in kinds:
                    label = f"{kind}, round {rnd + 1}"
                    await add_cell(
                        run,
                        self.cells,
                        {"round": rnd, "kind": kind},
                        label,
                        self._setup_cell(services, dsn, rnd, kind, label),
                    )
                fair = [(0, False)] + [(cfg.backlog_rows, False)] * bool(cfg.backlog_rows)
                if cfg.split and cfg.backlog_rows:
                    fair.insert(1 + rnd % 2, (cfg.backlog_rows, True))
                for rows, split in fair:
                    label = f"fairness{', split' * split}, {rows:,} backlog, round {rnd + 1}"
                    await add_cell(
                        run,
                        self.cells,
                        {"round": rnd, "kind": "fairness", "backlog": rows}
                        | ({"setup": "split"} if split else {}),
                        label,
                        self._fairness_cell(services, dsn, rnd, rows, label, split),
                    )
        finally:
            for db in self.db_names:
                await run.drop_database(services, db)

    async def _create(self, services: Services) -> str:
        """The databases and their outboxes, each migrated with ``notify_outbox.migrate``;
        the first database's DSN (the backlog's)."""
        from notify_outbox import OutboxNames, migrate

        t0 = time.monotonic()
        for n, db in enumerate(self.db_names):
            await services.admin(
                f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)', f'CREATE DATABASE "{db}"'
            )
            services.databases.append(db)
            self.dsns.append(dsn_for(services.dsn, db))
            async with connection(self.dsns[-1]) as conn:
                for i, schema in enumerate(self.schemas):
                    if self.db_of[schema] != n:
                        continue
                    self.run.progress.status(f"migrating outbox {i + 1}/{len(self.schemas)}")
                    await migrate(conn, OutboxNames(schema, "outbox", "notify_outbox"))
        seconds = time.monotonic() - t0
        self.run.result["database"] = {
            "outboxes": len(self.schemas),
            "databases": len(self.db_names),
            "migrate_s": seconds,
        }
        self.run.progress.line(f"{len(self.schemas)} outboxes migrated in {seconds:.1f}s")
        return self.dsns[0]

    def _table(self, schema: str) -> str:
        """The load generator's name of a schema's outbox (``i:`` its database's index)."""
        many = len(self.db_names) > 1
        return f"{self.db_of[schema]}:{schema}.outbox" if many else f"{schema}.outbox"

    def _fleet_env(self, split: bool) -> dict[str, str]:
        """How the fleet process is told what to serve: ``NOTIFY_OUTBOX_OUTBOXES`` for one
        database, a fleet file (``[[database]]`` tables) for several. ``split``: not t000."""
        if len(self.db_names) == 1:
            served = ",".join(f"{s}.outbox" for s in self.schemas[1:]) if split else "*"
            return {"NOTIFY_OUTBOX_OUTBOXES": served}
        lines = []
        for n, dsn in enumerate(self.dsns):
            mine = [f'"{s}.outbox"' for s in self.schemas if self.db_of[s] == n]
            if split and n == 0:
                mine = mine[1:]
                if not mine:
                    continue
            served = f"[{', '.join(mine)}]" if split and n == 0 else '"*"'
            lines += ["[[database]]", f'dsn = "{dsn}"', f"outboxes = {served}", ""]
        path = self.run.work / f"fleet-{'split' if split else 'all'}.toml"
        path.write_text("\n".join(lines))
        return {"NOTIFY_OUTBOX_FLEET_FILE": str(path)}

    async def _start(
        self,
        services: Services,
        dsn: str,
        schemas: list[str] | None,
        split: bool = False,
        extra: dict[str, str] | None = None,
    ) -> list[Child]:
        """The fleet (``schemas`` None) or a relay per schema, each running. ``split``: the
        fleet serves every outbox but the first, which a relay of its own serves."""
        run, env = self.run, {**self.cfg.relay_env, **(extra or {})}
        procs: list[Child] = []
        try:
            if schemas is None:
                procs.append(
                    await run.start(
                        services,
                        self.mode,
                        dsn,
                        name="fleet",
                        extra_env={**env, **self._fleet_env(split)},
                        wait_ready=False,
                    )
                )
                await procs[0].wait_for_log(_FLEET_READY, READY_TIMEOUT)
                if not split:
                    return procs
                schemas = self.schemas[:1]
            started = len(procs)
            for s in schemas:
                procs.append(
                    await run.start(
                        services,
                        self.mode,
                        self.dsns[self.db_of[s]],
                        name=f"relay-{s}",
                        extra_env={**env, "NOTIFY_OUTBOX_DB_SCHEMA": s},
                        wait_ready=False,
                    )
                )
            within = max(READY_TIMEOUT, 3.0 * len(procs))  # Python start-ups share 2 cores
            await asyncio.gather(*(p.wait_for_log(READY, within) for p in procs[started:]))
        except BaseException:
            await asyncio.gather(*(p.stop(5) for p in procs))
            raise
        return procs

    async def _stop(self, cell: dict[str, Any], procs: list[Child]) -> None:
        codes = await asyncio.gather(*(self.run.stop(p) for p in procs))
        cell["exit_codes"] = sorted({c for c in codes if c is not None})

    async def _topic(self, services: Services, cell: dict[str, Any]) -> tuple[str, Child]:
        """A fresh topic for the cell and a consumer on it."""
        topic = f"bench-fleet-{self.run.run_id.lower()}-{cell['cell']}"
        await create_topics(services.bootstrap, [topic], partitions=self.cfg.partitions)
        consumer = await self.run.start_consumer(
            services.bootstrap, topic, name=f"consumer-{cell['cell']}"
        )
        return topic, consumer

    async def _setup_cell(
        self, services: Services, dsn: str, rnd: int, kind: str, label: str
    ) -> dict[str, Any]:
        """The fleet, the per-outbox relays or the Kafka floor: idle window, then latency."""
        run, cfg = self.run, self.cfg
        cell = cell_record(len(self.cells) + 1, round=rnd, kind=kind)
        served = {"fleet": self.schemas, "per-outbox": self.schemas[: cfg.per_outbox_procs]}
        schemas = served.get(kind, [])
        cell["outboxes_served"] = len(schemas)
        topic, consumer = await self._topic(services, cell)
        procs: list[Child] = []
        try:
            if kind != "floor":
                run.progress.status(f"{label}: starting")
                t0 = time.monotonic()
                procs = await self._start(services, dsn, None if kind == "fleet" else schemas)
                cell["processes"] = len(procs)
                cell["ready_s"] = time.monotonic() - t0
                cell["idle"] = await self._idle(services, procs, label)
            tables = tuple(self._table(s) for s in schemas)
            cell["latency"] = await self._latency(services, dsn, topic, consumer, cell, tables)
        finally:
            await self._stop(cell, procs)
            await run.quit_consumer(consumer)
        lat, idle = cell["latency"], cell.get("idle")
        run.progress.line(
            f"{label:<24} "
            + (
                f"idle: {num(idle['statements_per_s'])} statements/s, "
                f"{num(idle['xacts_per_s'])} xacts/s, {idle['connections']} connections, "
                f"relay CPU {idle['relay_cpu_percent']:.2f}% | "
                if idle
                else ""
            )
            + f"{cfg.rate:g} ev/s: p50 {num(lat['p50'])} ms, p99 {num(lat['p99'])} ms, "
            f"{lat['missing']} missing",
            cell=True,
        )
        return cell

    async def _counters(self, services: Services) -> tuple[dict[str, Any], dict[Any, Any], int]:
        """The database's transactions and statements, its statements' calls, and the
        server connections to it (read through the maintenance database)."""
        names = self.db_names
        per_db = await db_counters(services.dsn, names, statements=self.statements)
        counts: dict[str, Any] = {}
        for key in ("xacts", "commits", "calls"):
            values = [per_db[db][key] for db in names if db in per_db]
            counts[key] = None if None in values else sum(values)
        counts["dealloc"] = next((per_db[db].get("dealloc") for db in names if db in per_db), None)
        calls: dict[int, tuple[str, int, int]] = {}
        if self.statements:
            for n, db in enumerate(names):
                for qid, row in (await statement_calls(services.dsn, db)).items():
                    calls[n * 2**64 + qid] = row  # query ids are per database
        async with connection(services.dsn) as conn:
            conns = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = ANY($1::text[])", names
            )
        return counts, calls, int(conns)

    async def _idle(self, services: Services, procs: list[Child], label: str) -> dict[str, Any]:
        """``settle`` seconds, then an ``idle_window`` with no new row: statements/s and
        transactions/s of the database, its connections, the relay processes' CPU."""
        cfg = self.cfg
        await self._wait(cfg.settle, f"{label}: settling")
        meter = CpuMeter(procs, self.postmaster)
        before, calls0, conns0 = await self._counters(services)
        cpu0, db0 = meter.read()
        seconds = await self._wait(cfg.idle_window, f"{label}: idle window")
        cpu1, db1 = meter.read()
        after, calls1, conns1 = await self._counters(services)
        out = quiet_record(before, after, calls0, calls1, seconds)
        out["connections"] = max(conns0, conns1)
        out["relay_cpu_percent"] = 100 * (cpu1 - cpu0) / seconds
        out["db_cpu_percent"] = (
            100 * (db1 - db0) / seconds if db0 is not None and db1 is not None else None
        )
        out["relay_rss_mib"] = sum(_rss_mib(p.pid) for p in procs)
        return out

    async def _wait(self, seconds: float, what: str) -> float:
        t0 = time.monotonic_ns()
        await self.run.pace(t0 + int(seconds * 1e9), lambda left: f"{what}: {left:.0f}s left")
        return (time.monotonic_ns() - t0) / 1e9

    async def _latency(
        self,
        services: Services,
        dsn: str,
        topic: str,
        consumer: Child,
        cell: dict[str, Any],
        tables: tuple[str, ...],
    ) -> dict[str, Any]:
        """``rate`` ev/s into a random one of ``tables`` per event (none: the Kafka floor)
        for ``warmup`` + ``latency_seconds``; commit ack -> receipt of the measured events."""
        run, cfg = self.run, self.cfg
        gen_path, got_path = run.array_paths(f"fleet-{cell['cell']}")
        lc = LoadConfig(
            dsn=dsn,
            topic=topic,
            cell=1,
            rate=cfg.rate,
            warmup=cfg.warmup,
            duration=cfg.latency_seconds,
            writers=writers_for(cfg.rate),
            out=str(gen_path),
            keys=cfg.keys,
            tables=tables,
            dsns=tuple(self.dsns) if len(self.dsns) > 1 and tables else (),
            sink="postgres" if tables else "kafka",
            bootstrap=services.bootstrap,
        )
        run.progress.status(f"cell {cell['cell']}: {cfg.rate:g} ev/s")
        gen = await run.start_loadgen(lc, name=f"writers-{cell['cell']}")
        try:
            writers = json.loads(await gen.read_line(lc.warmup + lc.duration + lc.grace + 60))
        finally:
            await gen.stop(10)
        answer = await run.collect(
            consumer, cell=1, expect=int(writers["acked"]), within=30.0, out=got_path
        )
        try:
            span = (int(writers["window_start"]), int(writers["window_end"]))
            return {
                "writers": writers,
                "consumer": answer,
                **_ack_recv(load_arrays(gen_path), load_arrays(got_path), *span),
            }
        finally:
            gen_path.unlink(missing_ok=True)
            got_path.unlink(missing_ok=True)

    async def _fairness_cell(
        self, services: Services, dsn: str, rnd: int, rows: int, label: str, split: bool
    ) -> dict[str, Any]:
        """The fleet with the other outboxes' events at ``rate`` for ``fairness_seconds``
        (at least until the backlog drained); ``lead`` in, ``rows`` committed in one
        transaction into the first outbox (``split``: served by a relay of its own)."""
        run, cfg = self.run, self.cfg
        cell = cell_record(len(self.cells) + 1, round=rnd, kind="fairness", backlog=rows)
        if split:
            cell["setup"] = "split"
        topic, consumer = await self._topic(services, cell)
        gen_path, got_path = run.array_paths(f"fleet-{cell['cell']}")
        backlog_path = got_path.with_name(f"fleet-{cell['cell']}-backlog.bin")
        procs: list[Child] = []
        gen: Child | None = None
        try:
            run.progress.status(f"{label}: starting the fleet")
            held = cfg.held_backlog > 0 and rows > 0
            extra = {"NOTIFY_OUTBOX_POLL_INTERVAL": "600"} if held else {}
            procs = await self._start(services, dsn, None, split, extra)
            gen, t0 = await run.start_steady_writers(
                dsn,
                topic,
                rate=cfg.rate,
                keys=cfg.keys,
                seconds=cfg.fairness_seconds + cfg.drain_timeout,
                out=gen_path,
                name=f"writers-{cell['cell']}",
                tables=tuple(self._table(s) for s in self.schemas[1:]),
                dsns=tuple(self.dsns) if len(self.dsns) > 1 else (),
            )
            alive = [(procs[0], "the fleet"), (gen, "the writers")]
            start = t0 + int(cfg.lead * 1e9)
            await run.pace(start, lambda left: f"{label}: lead-in {left:.0f}s", alive=alive)
            if rows:
                run.progress.status(f"{label}: inserting the backlog")
                cell["backlog_insert"] = await self._insert_backlog(dsn, topic, rows, held)
                if held:
                    wake = time.monotonic_ns() + int(cfg.held_backlog * 1e9)
                    await run.pace(wake, lambda left: f"{label}: backlog held {left:.0f}s")
                    async with connection(dsn) as conn:
                        await conn.execute(
                            "SELECT pg_notify('notify_outbox', $1)", f"{self.schemas[0]}.outbox"
                        )
                    cell["backlog_insert"]["wake_ns"] = time.monotonic_ns()
                run.progress.status(f"{label}: draining the backlog")
                cell["backlog_consumer"] = await run.collect(
                    consumer, cell=2, expect=rows, within=cfg.drain_timeout, out=backlog_path
                )
            end = start + int(cfg.fairness_seconds * 1e9)
            await run.pace(end, lambda left: f"{label}: {left:.0f}s left", alive=alive)
            end = time.monotonic_ns()
            writers = await run.stop_writers(gen)
            gen = None
            cell["writers"] = writers
            cell["consumer"] = await run.collect(
                consumer, cell=1, expect=int(writers["acked"]), within=60.0, out=got_path
            )
            g, got = load_arrays(gen_path), load_arrays(got_path)
            cell["others"] = _ack_recv(g, got, start, end)
            if rows:
                cell["drain"] = self._drain(cell["backlog_insert"], load_arrays(backlog_path))
                if cell["drain"]["last_ns"] is not None:
                    began = cell["backlog_insert"].get("wake_ns", cell["backlog_insert"]["ack_ns"])
                    during = (began, cell["drain"]["last_ns"])
                    cell["others_during_drain"] = _ack_recv(g, got, *during)
        finally:
            if gen is not None:
                await gen.stop(10)
            await self._stop(cell, procs)
            await run.quit_consumer(consumer)
            for path in (gen_path, got_path, backlog_path):
                path.unlink(missing_ok=True)
        if rows:
            async with connection(dsn) as conn:
                await conn.execute(f"VACUUM ANALYZE {self.schemas[0]}.outbox", timeout=300)
        o, d = cell["others"], cell.get("drain", {})
        during = cell.get("others_during_drain", {})
        run.progress.line(
            f"{label:<32} others: p50 {num(o['p50'])} ms, p99 {num(o['p99'])} ms"
            + (
                f" (during the drain: p50 {num(during.get('p50'))} ms, p99 "
                f"{num(during.get('p99'))} ms); drain {num(d.get('rows_per_s'))} rows/s in "
                f"{num(d.get('seconds'))} s"
                if rows
                else ""
            ),
            cell=True,
        )
        return cell

    async def _insert_backlog(
        self, dsn: str, topic: str, rows: int, quiet: bool = False
    ) -> dict[str, Any]:
        """``rows`` rows into the first outbox in one transaction (payload cell 2); ``quiet``:
        with the outbox's notify off meanwhile (nobody is told)."""
        config = f"{self.schemas[0]}.outbox_config"
        async with connection(dsn) as conn:
            mode = await conn.fetchval(f"SELECT notify_mode FROM {config}")
            if quiet:
                await conn.execute(f"UPDATE {config} SET notify_mode = 'off'")
            t0 = time.monotonic_ns()
            await conn.execute(
                f"INSERT INTO {self.schemas[0]}.outbox (topic, key, payload) "
                "SELECT $1, 'b' || (g % $2), jsonb_build_object('c', 2, 'i', g, 't', 0) "
                "FROM generate_series(0, $3::int - 1) AS g ORDER BY g",
                topic,
                self.cfg.backlog_keys,
                rows,
                timeout=_QUERY_TIMEOUT,
            )
            ack = time.monotonic_ns()
            if quiet:
                await conn.execute(f"UPDATE {config} SET notify_mode = $1", mode)
        return {"rows": rows, "insert_s": (ack - t0) / 1e9, "ack_ns": ack}

    def _drain(self, insert: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
        """How fast the backlog reached the consumer after its commit (after the NOTIFY that
        started its drain, when it was held)."""
        recv = got["recv"]
        ack = int(insert.get("wake_ns", insert["ack_ns"]))
        if len(recv) < insert["rows"]:
            return {"received": len(recv), "last_ns": None, "seconds": None, "rows_per_s": None}
        seconds = (max(recv) - ack) / 1e9
        return {
            "received": len(recv),
            "first_after_s": (min(recv) - ack) / 1e9,
            "last_ns": max(recv),
            "seconds": seconds,
            "rows_per_s": len(recv) / seconds if seconds > 0 else None,
        }


def _cells(result: dict[str, Any], kind: str, **more: Any) -> list[dict[str, Any]]:
    return [
        c
        for c in result.get("cells", [])
        if c.get("kind") == kind
        and "error" not in c
        and all(c.get(k) == v for k, v in more.items())
    ]


_IDLE_KEYS = (
    "statements_per_s",
    "xacts_per_s",
    "connections",
    "relay_cpu_percent",
    "relay_rss_mib",
    "db_cpu_percent",
)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds: the idle cost per setup (the per-outbox setup also scaled to
    every outbox), latency per setup, and the fairness cells; the issue's targets."""
    cfg = result["config"]
    idle: list[dict[str, Any]] = []
    latency: list[dict[str, Any]] = []
    for kind in ("fleet", "per-outbox", "floor"):
        cells = _cells(result, kind)
        if not cells:
            continue
        served = cells[0]["outboxes_served"]
        lat = [c["latency"] for c in cells if "latency" in c]
        latency.append(
            {
                "setup": kind,
                "outboxes": served,
                "rounds": len(lat),
                **{k: median(x.get(k) for x in lat) for k in ("p50", "p99", "max")},
                "missing": sum(x["missing"] for x in lat),
            }
        )
        runs = [c["idle"] for c in cells if "idle" in c]
        if not runs:
            continue
        row = {"setup": kind, "outboxes": served, "processes": cells[0].get("processes")}
        row |= {k: median(x.get(k) for x in runs) for k in _IDLE_KEYS}
        row["ready_s"] = median(c.get("ready_s") for c in cells)
        idle.append(row)
        if kind == "per-outbox" and served < cfg["outboxes"]:
            scale = cfg["outboxes"] / served
            scaled = {
                k: (row[k] * scale if row[k] is not None and k != "db_cpu_percent" else None)
                for k in _IDLE_KEYS
            }
            idle.append(
                {"setup": f"per-outbox, x{scale:.3g} (scaled)", "outboxes": cfg["outboxes"]}
                | {"processes": cfg["outboxes"], **scaled, "ready_s": None}
            )
    fairness = []
    fair_cells = _cells(result, "fairness")
    for setup, rows in dict.fromkeys((c.get("setup"), c.get("backlog")) for c in fair_cells):
        cells = _cells(result, "fairness", backlog=rows, setup=setup)
        others = [c["others"] for c in cells if "others" in c]
        during = [c["others_during_drain"] for c in cells if "others_during_drain" in c]
        drains = [c["drain"] for c in cells if "drain" in c]
        fairness.append(
            {
                "setup": setup or "fleet",
                "backlog": rows,
                "rounds": len(others),
                **{k: median(x.get(k) for x in others) for k in ("p50", "p99", "max")},
                **{f"drain_{k}": median(x.get(k) for x in during) for k in ("p50", "p99")},
                "drain_rows_per_s": median(d.get("rows_per_s") for d in drains),
                "drain_seconds": median(d.get("seconds") for d in drains),
                "missing": sum(x["missing"] for x in others),
            }
        )
    targets = []
    fleet = next((r for r in idle if r["setup"] == "fleet"), None)
    if fleet is not None:
        per_s, what = fleet["statements_per_s"], "statements/s (pg_stat_statements)"
        if per_s is None:
            per_s, what = fleet["xacts_per_s"], "transactions/s (pg_stat_database)"
        if per_s is not None:
            dbs = cfg.get("databases", 1)
            targets.append(
                target(
                    f"one fleet process, {fleet['outboxes']} idle outboxes: at most "
                    f"{_IDLE_TARGET:g} statements/s per database",
                    f"{per_s:.2f} {what}"
                    + (f" over {dbs} databases: {per_s / dbs:.2f} per database" if dbs > 1 else ""),
                    per_s / dbs <= _IDLE_TARGET,
                )
            )
    loaded = next((r for r in fairness if r["backlog"] and r["setup"] == "fleet"), None)
    if loaded is not None and loaded["drain_p99"] is not None:
        targets.append(
            target(
                f"the other outboxes' p99 <= {_FAIR_TARGET_MS:g} ms while one outbox drains "
                f"{loaded['backlog']:,} rows",
                f"p99 {loaded['drain_p99']:.1f} ms (p50 {num(loaded['drain_p50'])} ms; "
                f"drain {num(loaded['drain_rows_per_s'])} rows/s)",
                loaded["drain_p99"] <= _FAIR_TARGET_MS,
            )
        )
    return {"idle": idle, "latency": latency, "fairness": fairness, "targets": targets}


def problems(result: dict[str, Any]) -> list[str]:
    """What makes a fleet result wrong: a cell that failed, events that never arrived, a
    backlog that did not drain."""
    out = []
    for c in result.get("cells", []):
        where = f"cell {c['cell']} ({c['kind']}, round {c['round'] + 1})"
        needs = "others" if c["kind"] == "fairness" else "latency"
        out += unfinished(c, where, needs)
        missing = c.get(needs, {}).get("missing")
        if missing:
            out.append(f"{where}: {missing} committed events never arrived")
        if c.get("backlog") and c.get("drain", {}).get("last_ns") is None and needs in c:
            out.append(f"{where}: the backlog did not drain within the drain timeout")
    return out


def markdown(result: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    cfg = result["config"]
    lines = [f"# notify-outbox fleet {result['run_id']}", ""]
    lines += environment_lines(result)
    migrated = result.get("database", {}).get("migrate_s")
    dbs = cfg.get("databases", 1)
    where = (
        f"- one database, {cfg['outboxes']} outboxes (schemas t000, t001, ...; one channel), "
        f"migrated with `notify_outbox.migrate` in {num(migrated)} s; setups: **fleet**, one "
        "process with `NOTIFY_OUTBOX_OUTBOXES=*`"
        if dbs == 1
        else f"- {dbs} databases, {cfg['outboxes']} outboxes spread over them round robin "
        f"(schemas t000, t001, ...; one channel), migrated with `notify_outbox.migrate` in "
        f"{num(migrated)} s; setups: **fleet**, one process serving every database from a "
        'fleet file (a `[[database]]` table each, `outboxes = "*"`)'
    )
    lines += [
        where + "; **per-outbox**, one relay process per "
        f"outbox (`NOTIFY_OUTBOX_DB_SCHEMA`), {cfg['per_outbox_procs']} of them (the idle "
        f"figures also scaled linearly to {cfg['outboxes']}: a machine of 2 cores does not run "
        f"{cfg['outboxes']} Python processes); **floor**, no database (the load generator "
        f"sends straight to Kafka); {cfg['repeat']} round(s), setups alternating, medians",
        f"- idle: {cfg['settle']:g} s after start-up, then a {cfg['idle_window']:g} s window: "
        "statements/s from `pg_stat_statements` calls of the database (every statement a "
        "client sent, utility statements such as LISTEN and BEGIN too; counted at once), "
        "transactions/s from `pg_stat_database` (reported by backends up to ~1 s late, 10 s "
        "for one gone idle: hence the settling time), server connections to the database "
        "(`pg_stat_activity`, the larger of the window's first and last look), the relay "
        "processes' user+system CPU (/proc) and resident memory",
        f"- latency: {cfg['rate']:g} ev/s (single-row transactions, a random served outbox per "
        f"event), {cfg['warmup']:g} s warm-up then {cfg['latency_seconds']:g} s measured, "
        "commit ack -> consumer receipt",
        f"- fairness: the fleet with the other {cfg['outboxes'] - 1} outboxes' events at "
        f"{cfg['rate']:g} ev/s; {cfg.get('lead', 3.0):g} s in, {cfg['backlog_rows']:,} rows of "
        f"{cfg['backlog_keys']} keys committed in one transaction into t000; the others' "
        "latency over the cell and while the backlog drained (from its commit to the "
        "consumer's last backlog row), the drain's rows/s; next to the same cell without "
        "the backlog",
    ]
    if held := cfg.get("held_backlog"):
        lines.append(
            f"- the backlog held {held:g} s unannounced after its commit (its outbox's notify "
            "off, the relays' fallback polls 10 minutes apart), then its drain started by a "
            "NOTIFY naming its outbox: the drain window and rows/s count from that NOTIFY"
        )
    if env := cfg.get("relay_env"):
        lines.append("- relay settings: " + ", ".join(f"`{k}={v}`" for k, v in env.items()))
    lines += targets_section(summary, "issue #34")
    lines += ["", "## Idle cost (medians over rounds)", ""]
    lines += grid(
        summary["idle"],
        ("setup", lambda r: r["setup"]),
        ("outboxes", lambda r: str(r["outboxes"])),
        ("processes", lambda r: whole(r["processes"])),
        ("statements/s", lambda r: num(r["statements_per_s"])),
        ("transactions/s", lambda r: num(r["xacts_per_s"])),
        ("connections", lambda r: whole(r["connections"])),
        ("relay CPU %", lambda r: num(r["relay_cpu_percent"])),
        ("relay RSS MiB", lambda r: whole(r["relay_rss_mib"])),
        ("db CPU %", lambda r: num(r["db_cpu_percent"])),
        ("start-up s", lambda r: num(r["ready_s"], 1)),
    )
    lines += ["", f"## Latency at {cfg['rate']:g} ev/s (commit ack -> receipt, ms)", ""]
    lines += grid(
        summary["latency"],
        ("setup", lambda r: r["setup"]),
        ("outboxes written", lambda r: str(r["outboxes"] or "-")),
        ("p50", lambda r: num(r["p50"])),
        ("p99", lambda r: num(r["p99"])),
        ("max", lambda r: num(r["max"])),
        ("missing", lambda r: str(r["missing"])),
    )
    lines += ["", "## Fairness: one outbox draining a backlog (the fleet; ms)", ""]
    split = any(r.get("setup", "fleet") != "fleet" for r in summary["fairness"])
    if split:
        lines += [
            "**split**: the backlog's outbox served by a relay process of its own, the fleet "
            "serving the others (a control: what the host alone costs the others).",
            "",
        ]
    lines += grid(
        summary["fairness"],
        *([("setup", lambda r: r["setup"])] if split else []),
        ("backlog rows", lambda r: f"{r['backlog']:,}"),
        ("others p50", lambda r: num(r["p50"])),
        ("others p99", lambda r: num(r["p99"])),
        ("others max", lambda r: num(r["max"])),
        ("others p50 during drain", lambda r: num(r["drain_p50"])),
        ("others p99 during drain", lambda r: num(r["drain_p99"])),
        ("drain rows/s", lambda r: num(r["drain_rows_per_s"], 0)),
        ("drain s", lambda r: num(r["drain_seconds"], 1)),
    )
    tops = [c for c in _cells(result, "fleet") if "idle" in c][:1]
    tops += [c for c in _cells(result, "per-outbox") if "idle" in c][:1]
    if tops:
        lines += ["", "Statements in the idle window (first round; calls, rows):", ""]
        for c in tops:
            lines.append(f"- {c['kind']}:")
            lines += [
                f"  - {s['calls']} x, {s['rows']} rows: `{s['query']}`"
                for s in c["idle"]["top_statements"]
            ]
    lines += modes_section(result)
    return finish(lines, result, plots, problems(result))


def plot(result: dict[str, Any], summary: dict[str, Any], path: Path) -> bool:
    """No plot: the tables say it."""
    return False


REGIME = Regime.of(__name__, _Fleet.main, "## Targets", "## Idle cost", "## Latency", "## Fairness")
