"""The orchestrator of one run: services, environment, idle load, latency cells, producer
overhead; it writes the result JSON and hands it to the report."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import re
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import asyncpg

from bench import envinfo
from bench.analysis import analyse_cell
from bench.arrays import load_arrays
from bench.config import MODES, VARIANTS, Mode, RunConfig, TriggerVariant, writers_for
from bench.fmt import ms_aligned, opt
from bench.hist import Histogram
from bench.loadgen import LoadConfig
from bench.phase import READY_TIMEOUT, PhaseRun, loadavg, slug, utc
from bench.pooler import needs_pgbouncer
from bench.procs import BenchError, Child, cluster_cpu_seconds
from bench.profile import start_profiler, stop_profiler, top_self
from bench.regimes import database_postmaster
from bench.services import (
    Services,
    connection,
    db_counters,
    open_services,
    prepare_mode,
    set_notify,
    statements_delta,
)
from bench.stages import STAGE_LOG_ENV, StageLog, collect_stages
from devstack.relayproc import create_topics
from notify_outbox.core.names import OutboxNames
from notify_outbox.pg.sqlfiles import Queries

_QUERY_TIMEOUT = 30.0
_EMPTY_TIMEOUT = 30.0


@dataclass
class _ModeDb:
    mode: Mode
    dsn: str
    topic: str
    notify: dict[str, Any] = field(default_factory=dict)


class Runner:
    """Runs every phase of ``cfg`` and writes ``<out>/<UTC timestamp>.json``."""

    def __init__(self, cfg: RunConfig, out_dir: Path, *, keep_work_dir: bool = False) -> None:
        self.cfg = cfg
        # The run's lifecycle (work dir, source snapshot, services, environment, JSON) is the
        # one the drain and recovery phases use; this result file has no phase prefix.
        self._run = PhaseRun(None, cfg.to_json(), out_dir, keep=keep_work_dir)
        self.run_id, self.work, self.src = self._run.run_id, self._run.work, self._run.src
        self.progress, self.errors = self._run.progress, self._run.errors
        self.result = self._run.result
        self.result.update(
            {
                "modes": {name: MODES[name].to_json() for name in cfg.modes},
                "variants": {name: VARIANTS[name].to_json() for name in cfg.variants},
                "idle": [],
                "latency_cells": [],
                "producer_cells": [],
            }
        )
        self.result["baseline_cells"] = []
        self._cell_no = 0
        self._postmaster: int | None = None  # whose processes are the database's CPU
        self._dir_no = 0  # numbers the pgbench and closed-loop working directories

    # --- the run ------------------------------------------------------------------------------

    async def run(self) -> Path:
        """Run everything; returns the path of the JSON written. BenchError if the bench broke
        (the JSON is still written when there is something to write)."""
        # The producer variants' draining modes count too (none is pooled today).
        drains = [VARIANTS[v].drain_mode for v in self.cfg.variants]
        used = [MODES[m] for m in [*self.cfg.modes, *filter(None, drains)]]
        return await self._run.run(
            open_services,
            self._phases,
            fsync_seconds=self.cfg.fsync_test_seconds,
            pgbouncer=needs_pgbouncer(used),
        )

    async def _phases(self, services: Services) -> None:
        dbs = await self._setup_modes(services)
        if "idle" not in self.cfg.skip:
            await self._idle_phase(services, dbs)
        if "latency" not in self.cfg.skip:
            await self._latency_phase(services, dbs)
        if "producer" not in self.cfg.skip:
            await self._producer_phase(services)

    # --- set-up -------------------------------------------------------------------------------

    async def _setup_modes(self, services: Services) -> dict[str, _ModeDb]:
        dbs: dict[str, _ModeDb] = {}
        for name in self.cfg.modes:
            mode = MODES[name]
            self.progress.status(f"set-up: database and topic for {name}")
            topic = f"bench-{self.run_id.lower()}-{slug(name)}"
            dsn, notify = await prepare_mode(
                services,
                mode,
                f"bench_{self.run_id.lower()}_{slug(name)}",
                topic,
                partitions=self.cfg.partitions,
            )
            dbs[name] = _ModeDb(mode, dsn, topic, notify)
            self.result["modes"][name]["database_setup"] = notify
        return dbs

    async def _start_mode(
        self, services: Services, mode: Mode, dsn: str, extra_env: dict[str, str] | None = None
    ) -> Child | None:
        if mode.kind == "floor":  # the load generator is the floor's only process
            return None
        return await self._run.start(services, mode, dsn, name=mode.name, extra_env=extra_env)

    # --- idle ---------------------------------------------------------------------------------

    @property
    def _statements(self) -> bool:
        return bool(self.result["environment"].get("pg_stat_statements"))

    async def _idle_phase(self, services: Services, dbs: dict[str, _ModeDb]) -> None:
        """Every mode's process at once, no traffic: queries/s and commits/s of its own
        database (pg_stat_statements, pg_stat_database) and the process's CPU."""
        seconds = self.cfg.idle_seconds
        dbs = {name: db for name, db in dbs.items() if db.mode.kind != "floor"}  # no process
        self.progress.status(f"idle: starting {len(dbs)} processes")
        children: dict[str, Child] = {}
        try:
            started = await asyncio.gather(
                *(self._start_mode(services, db.mode, db.dsn) for db in dbs.values()),
                return_exceptions=True,
            )
            for name, child in zip(dbs, started, strict=True):
                if isinstance(child, Child):
                    children[name] = child
            for child in started:
                if isinstance(child, BaseException):
                    raise child
            await asyncio.sleep(min(5.0, max(1.0, seconds / 10)))  # let start-up work finish
            names = {name: _db_name(db.dsn) for name, db in dbs.items()}
            before = await db_counters(
                services.dsn, list(names.values()), statements=self._statements
            )
            cpu0 = {name: c.cpu() for name, c in children.items()}
            t0 = time.monotonic()
            await self._run.pace(
                time.monotonic_ns() + int(seconds * 1e9),
                lambda left: f"idle: measuring, {left:.0f}s left",
            )
            elapsed = time.monotonic() - t0
            after = await db_counters(
                services.dsn, list(names.values()), statements=self._statements
            )
            for name, child in children.items():
                db_name = names[name]
                b, a = before.get(db_name, {}), after.get(db_name, {})
                delta = statements_delta(b, a) if a and b else None
                calls = delta / elapsed if delta is not None else None
                xacts = (a["xacts"] - b["xacts"]) / elapsed if a and b else None
                record = {
                    "mode": name,
                    "seconds": round(elapsed, 2),
                    "queries_per_s": calls,
                    "commits_per_s": xacts,
                    "cpu_percent": 100.0 * (child.cpu() - cpu0[name]) / elapsed,
                }
                self.result["idle"].append(record)
                self.progress.line(
                    f"idle {name:<12} {opt(calls, '.2f', 'n/a')} queries/s, "
                    f"{opt(xacts, '.2f', 'n/a')} commits/s, "
                    f"CPU {record['cpu_percent']:.2f}%"
                )
        finally:
            for child in children.values():
                await self._run.stop(child)

    # --- latency ------------------------------------------------------------------------------

    async def _latency_phase(self, services: Services, dbs: dict[str, _ModeDb]) -> None:
        loads_of: dict[str, list[float]] = {}
        cfg = self.cfg
        self._postmaster = await database_postmaster(services, self._run)
        relays = [db for db in dbs.values() if db.mode.kind == "relay"]
        baseline: _ModeDb | None = None
        if cfg.db_baseline and relays and self._postmaster is not None:
            baseline = await self._baseline_db(services)
        for rep in range(cfg.repeat):
            for db in dbs.values():
                await self._mode_block(services, db, rep, loads_of)
            if baseline is not None:
                loads = sorted({x for db in relays for x in loads_of.get(db.mode.name, [])})
                for load in loads:
                    await self._baseline_cell(baseline, rep, load)

    async def _baseline_db(self, services: Services) -> _ModeDb:
        """The outbox of the database's baseline: migrated by this checkout, its triggers as
        shipped, served by no relay."""
        name = "writers"
        mode = replace(MODES["notify"], name=name, description="no relay")
        topic = f"bench-{self.run_id.lower()}-{name}"
        dsn, notify = await prepare_mode(
            services, mode, f"bench_{self.run_id.lower()}_{name}", topic, partitions=1
        )
        self.result["baseline"] = {
            "description": "the same load generator and writers at each load, into an outbox "
            "migrated by this checkout with its triggers as shipped and no relay: nothing is "
            "published (so every commit NOTIFYs, no relay being awake); its database CPU per "
            "event is subtracted from each mode's",
            "database_setup": notify,
        }
        return _ModeDb(mode, dsn, topic, notify)

    async def _baseline_cell(self, db: _ModeDb, rep: int, load: float) -> None:
        """One cell of the database's baseline: the writers alone, its rows deleted after."""
        assert self._postmaster is not None
        cfg = self.cfg
        label = f"no relay {load:g} ev/s rep {rep + 1}"
        n, lc = self._load_config(db, load, label, sink="postgres", bootstrap="")
        gen_path = Path(lc.out)
        writers = lc.writers
        db0 = cluster_cpu_seconds(self._postmaster)
        gen = await self._run.start_loadgen(lc, name=f"loadgen-{n}")
        try:
            summary = json.loads(await gen.read_line(cfg.warmup + cfg.duration + lc.grace + 60.0))
            code = await gen.wait(10)
            if code != 0:
                raise BenchError(f"load generator of cell {n} exited {code}:\n{gen.tail()}")
        finally:
            await gen.stop(5)
        db1 = cluster_cpu_seconds(self._postmaster)
        ack = load_arrays(gen_path)["ack"]
        for p in (gen_path, gen_path.with_suffix(".config.json")):
            p.unlink(missing_ok=True)
        async with connection(db.dsn, within=_QUERY_TIMEOUT) as conn:
            await conn.execute("DELETE FROM outbox", timeout=_QUERY_TIMEOUT)
        start, end = summary["window_start"], summary["window_end"]
        seconds = (end - start) / 1e9
        events = summary["acked"]
        db_cpu = db1 - db0 if db0 is not None and db1 is not None else None
        cell = {
            "cell": n,
            "mode": db.mode.name,
            "rep": rep,
            "load": load,
            "writers": writers,
            "events": events,
            "commit_rate": sum(1 for v in ack if start <= v < end) / seconds if seconds else 0.0,
            "db_cpu_s": round(db_cpu, 3) if db_cpu is not None else None,
            "db_cpu_us_per_event": (
                round(1e6 * db_cpu / events, 1) if db_cpu is not None and events else None
            ),
        }
        self.result["baseline_cells"].append(cell)
        self.progress.line(
            f"{label:<42} commit {cell['commit_rate']:8.0f}/s  database CPU "
            f"{opt(cell['db_cpu_us_per_event'], '.0f')} µs per event",
            cell=True,
        )

    async def _mode_block(
        self, services: Services, db: _ModeDb, rep: int, loads_of: dict[str, list[float]]
    ) -> None:
        cfg = self.cfg
        name = db.mode.name
        self.progress.status(f"{name} rep {rep + 1}: starting consumer and {db.mode.kind}")
        consumer = await self._run.start_helper(
            f"consumer {name}", "_consumer", services.bootstrap, db.topic, log=f"consumer-{name}"
        )
        process: Child | None = None
        conn: asyncpg.Connection | None = None
        stage_log: StageLog | None = None
        if cfg.stages and db.mode.kind == "relay":
            stage_log = StageLog(self.work / "stages" / f"{slug(name)}-rep{rep + 1}.jsonl")
            stage_log.path.parent.mkdir(parents=True, exist_ok=True)
        extra_env = {STAGE_LOG_ENV: str(stage_log.path)} if stage_log is not None else None
        try:
            starting = asyncio.ensure_future(self._start_mode(services, db.mode, db.dsn, extra_env))
            try:
                ready = json.loads(await consumer.read_line(READY_TIMEOUT))
            finally:
                process = await starting
            if not ready.get("ready"):
                raise BenchError(f"consumer for {name} did not get ready: {ready}")
            if db.dsn:  # the floor has no database
                conn = await asyncpg.connect(db.dsn, timeout=_QUERY_TIMEOUT)
            cell = functools.partial(
                self._cell, services, db, consumer, process, conn, rep, stage_log=stage_log
            )
            planned = loads_of.get(name)
            if planned is None:
                done: list[float] = []
                queue = list(cfg.loads)
                while queue:
                    load = queue.pop(0)
                    record = await cell(load)
                    if not record["keeps_up"]:
                        # One noisy minute must not end the climb: a load counts as saturated
                        # only when a second attempt fails too (both are kept and reported).
                        self.progress.line(f"{name} {load:g} ev/s: not keeping up; once more")
                        record = await cell(load, attempt=2)
                    done.append(load)
                    if not record["keeps_up"]:
                        break
                    if not queue and cfg.extend_loads and load * 1.5 <= cfg.max_load:
                        queue.append(float(math.ceil(load * 1.5 / 500.0) * 500))
                loads_of[name] = done
            else:
                for load in planned:
                    await cell(load)
            if name in cfg.variant_modes:
                for arrival, producer in (("poisson", "sql"), ("constant", "enqueue")):
                    if producer == "enqueue" and db.mode.kind == "floor":
                        continue  # the Python API writes to the database the floor has not
                    profile = cfg.profile and rep == 0 and producer == "sql"
                    await cell(
                        cfg.variant_load, arrival=arrival, producer=producer, profile=profile
                    )
        finally:
            if conn is not None:
                await conn.close(timeout=5)
            await self._run.quit_consumer(consumer)
            if process is not None:
                await self._run.stop(process)

    async def _cell(
        self,
        services: Services,
        db: _ModeDb,
        consumer: Child,
        process: Child | None,
        conn: asyncpg.Connection | None,
        rep: int,
        load: float,
        *,
        arrival: str = "constant",
        producer: str = "sql",
        profile: bool = False,
        attempt: int = 1,
        stage_log: StageLog | None = None,
    ) -> dict[str, Any]:
        cfg = self.cfg
        label = f"{db.mode.name} {load:g} ev/s {arrival}/{producer} rep {rep + 1}"
        n, lc = self._load_config(
            db,
            load,
            label,
            producer=producer,
            arrival=arrival,
            sink="kafka" if db.mode.kind == "floor" else "postgres",
            bootstrap=services.bootstrap,
        )
        writers = lc.writers
        gen_path, got_path = self._run.array_paths(f"c{n}")
        cpu0 = process.cpu() if process is not None else 0.0
        host0 = envinfo.cpu_times()
        db0 = self._db_cpu(db)
        started = utc()
        gen = await self._run.start_loadgen(lc, name=f"loadgen-{n}")
        profiler = None
        if profile and process is not None:
            profiler = await self._start_profiler(process, n)
        try:
            limit = cfg.warmup + cfg.duration + lc.grace + 60.0
            summary = json.loads(await gen.read_line(limit))
            code = await gen.wait(10)
            if code != 0:
                raise BenchError(f"load generator of cell {n} exited {code}:\n{gen.tail()}")
        finally:
            await gen.stop(5)
        self.progress.status(f"{label}: waiting for {summary['acked']} events at the consumer")
        reply = await self._run.collect(
            consumer, cell=n, expect=summary["acked"], within=cfg.drain_timeout, out=got_path
        )
        cpu_used = process.cpu() - cpu0 if process is not None else None
        host1 = envinfo.cpu_times()
        profile_summary: dict[str, Any] | None = None
        if profiler is not None:
            await stop_profiler(profiler[0])
            profile_summary = {"file": profiler[1].name, **top_self(profiler[1])}
        gen_arrays, got_arrays = load_arrays(gen_path), load_arrays(got_path)
        window = (summary["window_start"], summary["window_end"])
        analysis = analyse_cell(gen_arrays, got_arrays, *window)
        drained, residual = await self._wait_empty(conn) if conn is not None else (True, 0)
        # Counted until the outbox emptied: the marks of the cell's last rows are the relay's.
        db1 = self._db_cpu(db)
        db_cpu = db1 - db0 if db0 is not None and db1 is not None else None
        # After the outbox emptied: every claim of the cell is marked, its line written.
        stages = (
            await collect_stages(stage_log, gen_arrays, got_arrays, n, *window)
            if stage_log is not None
            else None
        )
        for p in (gen_path, got_path, gen_path.with_suffix(".config.json")):
            p.unlink(missing_ok=True)
        total_events = summary["acked"]
        cell: dict[str, Any] = {
            "cell": n,
            "mode": db.mode.name,
            "rep": rep,
            "attempt": attempt,
            "load": load,
            "arrival": arrival,
            "producer": producer,
            "writers": writers,
            "warmup": cfg.warmup,
            "duration": cfg.duration,
            "started_utc": started,
            "generator": {k: summary[k] for k in ("events", "sent", "acked", "errors")},
            "generator_error": summary.get("first_error"),
            "consumer": reply,
            "mode_cpu_s": round(cpu_used, 3) if cpu_used is not None else None,
            "mode_cpu_us_per_event": (
                round(1e6 * cpu_used / total_events, 1)
                if total_events and cpu_used is not None
                else None
            ),
            "host_cpu_busy": envinfo.busy_share(host0, host1),
            "db_cpu_s": round(db_cpu, 3) if db_cpu is not None else None,
            "db_cpu_us_per_event": (
                round(1e6 * db_cpu / total_events, 1)
                if total_events and db_cpu is not None
                else None
            ),
            "load_average": loadavg(),
            "drained": drained,
            "residual_rows": residual,
            **analysis,
        }
        if profile_summary is not None:
            cell["profile"] = profile_summary
        if stages is not None:
            cell["stage_log"] = stages
        self.result["latency_cells"].append(cell)
        lat = cell["latency"]["e2e"]
        ack = cell["latency"]["ack_to_recv"]
        verdict = "sustained" if cell["sustained"] else "keeps up" if cell["keeps_up"] else "NO"
        self.progress.line(
            f"{label:<42} commit {cell['commit_rate']:8.0f}/s  e2e p50 {ms_aligned(lat['p50'])} "
            f"p99 {ms_aligned(lat['p99'])} max {ms_aligned(lat['max'])} | ack->recv p50 "
            f"{ms_aligned(ack['p50'])} p99 {ms_aligned(ack['p99'])} | {verdict}"
            + (f" missing {cell['missing']}" if cell["missing"] else "")
            + (f" | {_stages_note(stages)}" if stages is not None else ""),
            cell=True,
        )
        if cell["missing"] and cell["keeps_up"] is False and load <= 1000:
            # At a light load every event must arrive: a loss there is a broken bench (or
            # relay), not saturation.
            self.errors.append(
                f"cell {n} ({label}): {cell['missing']} of {cell['events']} events never arrived"
            )
        return cell

    def _load_config(
        self, db: _ModeDb, load: float, label: str, **kw: Any
    ) -> tuple[int, LoadConfig]:
        """The next cell's number and its load generator's config (``kw``: LoadConfig's
        fields that differ between cells), its start announced."""
        cfg = self.cfg
        self._cell_no += 1
        n = self._cell_no
        self.progress.status(f"{label}: running ({cfg.warmup:g}s warm-up + {cfg.duration:g}s)")
        gen_path, _ = self._run.array_paths(f"c{n}")
        return n, LoadConfig(
            dsn=db.dsn,
            topic=db.topic,
            cell=n,
            rate=load,
            warmup=cfg.warmup,
            duration=cfg.duration,
            writers=cfg.writers or writers_for(load),
            out=str(gen_path),
            keys=cfg.keys,
            seed=n,
            grace=max(2.0, cfg.duration / 2),
            tx_events=cfg.tx_events,
            **kw,
        )

    def _db_cpu(self, db: _ModeDb) -> float | None:
        """The database's CPU seconds so far (None for the floor, which has no database, or
        when the server's processes are not visible here)."""
        if not db.dsn or self._postmaster is None:
            return None
        return cluster_cpu_seconds(self._postmaster)

    async def _wait_empty(self, conn: asyncpg.Connection) -> tuple[bool, int]:
        """Wait until the outbox is empty; after the deadline, delete what is left."""
        deadline = time.monotonic() + _EMPTY_TIMEOUT
        while True:
            left = int(await conn.fetchval("SELECT count(*) FROM outbox", timeout=_QUERY_TIMEOUT))
            if left == 0:
                return True, 0
            if time.monotonic() > deadline:
                await conn.execute("DELETE FROM outbox", timeout=_QUERY_TIMEOUT)
                return False, left
            await asyncio.sleep(0.1)

    async def _start_profiler(
        self, process: Child, n: int
    ) -> tuple[asyncio.subprocess.Process, Path] | None:
        """py-spy on the mode's process, and the raw profile it writes."""
        out = self._run.out_dir / f"{self.run_id}-profile-{slug(process.name)}-cell{n}.txt"
        proc = await start_profiler(process.pid, out)
        if proc is None:
            self.result["notes"].append("profile asked, but py-spy is not installed")
            return None
        return proc, out

    # --- producer overhead --------------------------------------------------------------------

    async def _producer_phase(self, services: Services) -> None:
        cfg = self.cfg
        if not cfg.variants or not cfg.producer_writers:
            return
        self.progress.status("producer overhead: set-up")
        dsn = await services.create_database(f"bench_{self.run_id.lower()}_producer")
        topic = f"bench-{self.run_id.lower()}-producer"
        await create_topics(services.bootstrap, [topic], partitions=cfg.partitions)
        pgbench = _find_pgbench()
        self.result["producer_driver"] = "pgbench" if pgbench else "python"
        async with connection(dsn, within=_QUERY_TIMEOUT) as conn:
            original = await conn.fetchval(
                "SELECT CASE WHEN to_regclass('public.outbox_config') IS NULL THEN NULL "
                "ELSE (SELECT notify_mode FROM outbox_config) END"
            )
            for rep in range(cfg.producer_repeat):
                for vname in cfg.variants:
                    variant = VARIANTS[vname]
                    await self._variant_block(
                        services, conn, dsn, topic, variant, rep, pgbench, original
                    )

    async def _variant_block(
        self,
        services: Services,
        conn: asyncpg.Connection,
        dsn: str,
        topic: str,
        variant: TriggerVariant,
        rep: int,
        pgbench: Path | None,
        original_mode: str | None,
    ) -> None:
        await conn.execute("ALTER TABLE outbox ENABLE TRIGGER USER")
        if original_mode is not None:
            await conn.execute("UPDATE outbox_config SET notify_mode = $1", original_mode)
        try:
            setup = await set_notify(dsn, variant.notify)
        except BenchError as e:
            if rep == 0:
                self.result["notes"].append(f"variant {variant.name} skipped: {e}")
                self.progress.line(f"producer {variant.name}: skipped ({e})")
            return
        drain: Child | None = None
        awake: asyncio.Task[None] | None = None
        try:
            if variant.drain_mode is not None:
                drain = await self._start_mode(services, MODES[variant.drain_mode], dsn)
            if variant.hold_awake:
                awake = await _hold_awake(dsn)
            for writers in self.cfg.producer_writers:
                await conn.execute("SET lock_timeout = '10s'")
                await conn.execute("TRUNCATE outbox")
                label = f"producer {variant.name} {writers} writer(s) rep {rep + 1}"
                self.progress.status(f"{label}: running {self.cfg.producer_seconds:g}s")
                cpu0 = drain.cpu() if drain else 0.0
                if pgbench is not None:
                    res = await self._pgbench(pgbench, dsn, topic, writers)
                else:
                    res = await self._python_writers(dsn, topic, writers)
                cell = {
                    "variant": variant.name,
                    "rep": rep,
                    "writers": writers,
                    "setup": setup,
                    "drain_cpu_s": round(drain.cpu() - cpu0, 3) if drain else None,
                    "load_average": loadavg(),
                    **res,
                }
                self.result["producer_cells"].append(cell)
                lat = cell["latency"]
                self.progress.line(
                    f"{label:<46} {cell['commits_per_s']:8.0f} commits/s  "
                    f"latency p50 {ms_aligned(lat['p50'])} p99 {ms_aligned(lat['p99'])}",
                    cell=True,
                )
        finally:
            if awake is not None:
                awake.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await awake
            if drain is not None:
                await self._run.stop(drain)
            await conn.execute("TRUNCATE outbox")

    async def _pgbench(self, pgbench: Path, dsn: str, topic: str, writers: int) -> dict[str, Any]:
        run_dir = self.work / "pgbench" / f"{self._dir_no}-{writers}"
        self._dir_no += 1
        run_dir.mkdir(parents=True, exist_ok=True)
        script = run_dir / "insert.sql"
        script.write_text(
            "\\set k random(1, 1000)\n"
            f"INSERT INTO outbox (topic, key, payload) VALUES ('{topic}', 'k' || :k, "
            "'{\"p\": 1}');\n"
        )
        seconds = max(1, round(self.cfg.producer_seconds))
        argv = [
            str(pgbench),
            "-n",
            "-M",
            "prepared",
            "-c",
            str(writers),
            "-j",
            str(min(writers, 2)),
        ]
        argv += [
            "-T",
            str(seconds),
            "-f",
            str(script),
            "-l",
            f"--log-prefix={run_dir / 'log'}",
            dsn,
        ]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=str(run_dir),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), seconds + 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise BenchError("pgbench did not finish in time") from None
        text = out.decode(errors="replace")
        if proc.returncode != 0:
            raise BenchError(f"pgbench failed ({proc.returncode}):\n{text[-2000:]}")
        hist = Histogram()
        for log in run_dir.glob("log.*"):
            with log.open() as fh:
                for line in fh:
                    parts = line.split()
                    if len(parts) >= 3:
                        hist.record(int(parts[2]))
        m = re.search(r"tps = ([\d.]+) \(without initial connection time\)", text)
        tps = float(m.group(1)) if m else hist.count / seconds
        failed = re.search(r"number of failed transactions: (\d+)", text)
        shutil.rmtree(run_dir, ignore_errors=True)
        return {
            "driver": "pgbench",
            "seconds": seconds,
            "commits": hist.count,
            "commits_per_s": tps,
            "failed": int(failed.group(1)) if failed else 0,
            "latency": hist.summary_ms(),
            "hist": hist.to_json(),
        }

    async def _python_writers(self, dsn: str, topic: str, writers: int) -> dict[str, Any]:
        cells_dir = self.work / "cells"
        cells_dir.mkdir(parents=True, exist_ok=True)
        self._dir_no += 1
        config_path = cells_dir / f"closed-{self._dir_no}.json"
        LoadConfig(
            dsn=dsn,
            topic=topic,
            cell=0,
            rate=0,
            warmup=0,
            duration=self.cfg.producer_seconds,
            writers=writers,
            out="",
            keys=self.cfg.keys,
            closed=True,
        ).save(config_path)
        gen = await self._run.start_helper(
            "closed-loop writers", "_loadgen", str(config_path), log="closed-loop"
        )
        try:
            summary = json.loads(await gen.read_line(self.cfg.producer_seconds + 60))
        finally:
            await gen.stop(5)
        hist = Histogram.from_json(summary["latency"])
        return {
            "driver": "python",
            "seconds": summary["elapsed"],
            "commits": summary["commits"],
            "commits_per_s": summary["commits_per_s"],
            "failed": summary["errors"],
            "latency": hist.summary_ms(),
            "hist": hist.to_json(),
        }


def _find_pgbench() -> Path | None:
    try:
        from devstack.postgres import find_pg_bindir

        path = find_pg_bindir() / "pgbench"
    except Exception:
        found = shutil.which("pgbench")
        return Path(found) if found else None
    return path if path.is_file() else None


def _db_name(dsn: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(dsn).path.lstrip("/")


def _stages_note(stages: dict[str, Any]) -> str:
    if stages["status"] != "ok":
        return str(stages["status"])
    return (
        f"stage log: {stages['claims']} claims, {stages['missing_lines']} of "
        f"{stages['events']} events without a line"
    )


async def _hold_awake(dsn: str) -> asyncio.Task[None]:
    """Hold the gated notify's awake marker from a side connection, as an awake relay does
    (migration 0006: the current and the next epoch, renewed every half epoch), until the
    task is cancelled. Raises BenchError when it cannot be taken (a relay holds it)."""
    conn = await asyncpg.connect(dsn, timeout=_QUERY_TIMEOUT)
    queries = Queries(OutboxNames())
    epoch_ms: int = await conn.fetchval("SELECT awake_epoch_ms FROM outbox_config")
    held: list[int] = await conn.fetchval(queries["hold_awake"], [], epoch_ms)
    if not held:
        await conn.close(timeout=5)
        raise BenchError("could not take the awake marker: is a relay running?")

    async def renew() -> None:
        nonlocal held
        try:
            while True:
                await asyncio.sleep(epoch_ms / 2000)
                held = await conn.fetchval(queries["hold_awake"], held, epoch_ms)
        finally:
            await conn.close(timeout=5)

    return asyncio.create_task(renew(), name="bench-awake-marker")
