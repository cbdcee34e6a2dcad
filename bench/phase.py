"""What every run of the bench shares, the latency run's and each regime's: a run id, a work
directory with the relay source snapshot, the services, the environment record, progress, the
child processes (modes, load generator, consumer), pacing, and the result JSON (written even
when the run fails half-way, then turned into markdown and plots)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import asyncpg

from bench import envinfo
from bench.config import Mode, writers_for
from bench.loadgen import LoadConfig
from bench.pooler import end_record, mode_dsns, start_pgbouncer
from bench.procs import ROOT, BenchError, Child, python_argv
from bench.revs import label_modes
from bench.services import Services, close_services, make_work_dir, remove_work_dir
from devstack.relayproc import READY, child_env, cli_argv, relay_env

READY_TIMEOUT = 60.0  # a child process's start, until it says it is ready
_STOP_TIMEOUT = 40.0  # above the relay's default shutdown_timeout (30 s)


class Progress:
    """Progress on stderr: ``status()`` rewrites a live line (terminal only), ``line()`` prints
    a lasting one, with the time and the cells done."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.total = 0  # cells
        self.done = 0
        self._live = sys.stderr.isatty()
        self._shown = False

    def _stamp(self) -> str:
        s = int(time.monotonic() - self.start)
        cells = f" {self.done}/{self.total}" if self.total else ""
        return f"[{s // 60:02d}:{s % 60:02d}{cells}]"

    def _clear(self) -> None:
        if self._shown:
            sys.stderr.write("\r\x1b[2K")
            self._shown = False

    def status(self, text: str) -> None:
        """Show what is happening now."""
        if not self._live:
            return
        width = shutil.get_terminal_size((100, 20)).columns - 1
        self._clear()
        sys.stderr.write(f"{self._stamp()} {text}"[:width])
        sys.stderr.flush()
        self._shown = True

    def line(self, text: str, *, cell: bool = False) -> None:
        """Print a lasting line (``cell``: one more cell is done)."""
        if cell:
            self.done += 1
        self._clear()
        sys.stderr.write(f"{self._stamp()} {text}\n")
        sys.stderr.flush()


def utc() -> str:
    """Now, UTC, ISO 8601 to the second."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def slug(name: str) -> str:
    """``name`` as a lower-case identifier (database and topic names)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def snapshot_source(work: Path) -> tuple[Path, dict[str, Any]]:
    """Copy ``notify_outbox/`` and ``sql/`` into ``work/src``, every child's working
    directory, so that edits to the checkout during a run cannot mix two versions."""
    src = work / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "notify_outbox", src / "notify_outbox", ignore=ignore)
    shutil.copytree(ROOT / "sql", src / "sql", ignore=ignore)
    digest = hashlib.sha256()
    files = sorted(p for p in src.rglob("*") if p.is_file())
    for p in files:
        digest.update(str(p.relative_to(src)).encode() + b"\0" + p.read_bytes() + b"\0")
    return src, {"sha256": digest.hexdigest(), "files": len(files)}


async def record_environment(
    services: Services,
    work: Path,
    src_digest: dict[str, Any],
    *,
    fsync_seconds: int,
    progress: Progress,
    notes: list[str],
    load_average: list[float],
) -> dict[str, Any]:
    """The environment record of a result (machine, fsync, PostgreSQL, Kafka, libraries, git);
    also creates ``pg_stat_statements`` where it can (a note says when it cannot)."""
    progress.status("recording the environment")
    env: dict[str, Any] = {
        "host": envinfo.host_info(),
        "libraries": envinfo.library_versions(),
        "git": await asyncio.to_thread(envinfo.git_info),
        "services": "own devstack Stack (durable=True)" if services.own_stack else "env",
        "relay_source": {"snapshot_of": str(ROOT), **src_digest},
    }
    probe_dir = work / "stack" if services.own_stack else work
    probe_dir.mkdir(parents=True, exist_ok=True)
    env["fdatasync_probe"] = await asyncio.to_thread(envinfo.fdatasync_probe, probe_dir, 1.0)
    if fsync_seconds > 0:
        progress.status(f"pg_test_fsync -s {fsync_seconds}")
        env["pg_test_fsync"] = await asyncio.to_thread(
            envinfo.pg_test_fsync, probe_dir, fsync_seconds
        )
    env["postgres"] = await envinfo.postgres_info(services.dsn)
    env["kafka"] = {
        "version": services.kafka_version or "unknown (external broker)",
        "broker_configs": await services.broker_configs(),
    }
    try:
        await services.admin("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        # Entries of databases dropped since (earlier runs' own) fill the store until new ones
        # evict entries under measurement: forgotten here, as nobody can read them.
        await services.admin(
            "SELECT pg_stat_statements_reset(0, g.dbid, 0) FROM (SELECT DISTINCT dbid FROM "
            "pg_stat_statements WHERE dbid NOT IN (SELECT oid FROM pg_database)) AS g"
        )
        env["pg_stat_statements"] = True
    except asyncpg.PostgresError as e:
        env["pg_stat_statements"] = False
        notes.append(f"pg_stat_statements unavailable: {e}")
    fs = env["fdatasync_probe"]
    pg = env["postgres"]["settings"]
    progress.line(
        f"env: {env['host']['cpu_model']} x{env['host']['cores']}, "
        f"fdatasync median {fs['median_us']} µs, PostgreSQL {pg.get('server_version')} "
        f"synchronous_commit={pg.get('synchronous_commit')} fsync={pg.get('fsync')}, "
        f"load {load_average}"
    )
    return env


async def start_mode(
    services: Services,
    mode: Mode,
    dsn: str,
    *,
    src: Path,
    log_path: Path,
    extra_env: dict[str, str] | None = None,
    wait_ready: bool = True,
) -> Child:
    """Start a mode's process on ``dsn`` from the snapshot ``src`` (or the mode's own
    tree), and unless ``wait_ready`` is false wait until it logs that it runs."""
    if mode.kind == "relay":
        argv = cli_argv("run", *mode.args)
    else:
        argv = python_argv("-m", "bench", "_poller", *mode.args)
    # A pooled mode's DSN is rewritten here, for its process only (bench/pooler.py).
    dsns = mode_dsns(services, mode, dsn)
    env = relay_env(
        dsns.pop("NOTIFY_OUTBOX_DSN"),
        services.bootstrap,
        **{**dsns, **dict(mode.env), **(extra_env or {})},
    )
    cwd = Path(mode.cwd) if mode.cwd else src
    if mode.cwd:
        # `python -m` puts the working directory first on sys.path: that tree's relay wins.
        env["PYTHONPATH"] = f"{cwd}{os.pathsep}{env['PYTHONPATH']}"
    child = await Child.start(mode.name, argv, env=env, log_path=log_path, cwd=cwd)
    if wait_ready:
        await wait_mode_ready(child, mode)
    return child


async def wait_mode_ready(child: Child, mode: Mode) -> None:
    """Wait (bounded) until a process of ``mode`` logs that it runs; stop it on failure."""
    ready = READY if mode.kind == "relay" else "poller running"
    try:
        await child.wait_for_log(ready, READY_TIMEOUT)
    except BaseException:
        await child.stop(5)
        raise


def _clean(o: Any) -> Any:
    """``o`` with every NaN replaced by None (JSON has no NaN)."""
    if isinstance(o, float) and math.isnan(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    return o


class PhaseRun:
    """One run of a phase: ``run(body)`` opens the services, records the environment, runs
    ``body`` and writes ``<out>/[<phase>-]<UTC timestamp>.json``."""

    def __init__(
        self, phase: str | None, config: dict[str, Any], out_dir: Path, *, keep: bool
    ) -> None:
        self.phase = phase
        self.out_dir = out_dir
        self.keep = keep
        self.run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        self.work = make_work_dir()
        self.src, self.src_digest = snapshot_source(self.work)
        self.progress = Progress()
        self.errors: list[str] = []
        self.notes: list[str] = []
        self._log_no = 0
        self.result: dict[str, Any] = {
            "schema": 1,
            **({"phase": phase} if phase else {}),
            "run_id": self.run_id,
            "started_utc": utc(),
            "config": config,
            "notes": self.notes,
        }

    @property
    def path(self) -> Path:
        """Where the result JSON goes."""
        prefix = f"{self.phase}-" if self.phase else ""
        return self.out_dir / f"{prefix}{self.run_id}.json"

    def log_path(self, what: str) -> Path:
        """A new numbered log file in the work directory."""
        self._log_no += 1
        return self.work / "logs" / f"{self._log_no:03d}-{slug(what)}.log"

    async def start(
        self,
        services: Services,
        mode: Mode,
        dsn: str,
        *,
        name: str,
        extra_env: dict[str, str] | None = None,
        wait_ready: bool = True,
    ) -> Child:
        """Start one process of ``mode`` (see ``bench.runner.start_mode``)."""
        return await start_mode(
            services,
            mode,
            dsn,
            src=self.src,
            log_path=self.log_path(name),
            extra_env=extra_env,
            wait_ready=wait_ready,
        )

    async def start_all(
        self,
        services: Services,
        mode: Mode,
        dsn: str,
        names: list[str],
        into: list[Child],
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """Start a process of ``mode`` per name (appended to ``into``, so that the caller stops
        those started if one fails), then wait until every one runs."""
        for name in names:
            into.append(
                await self.start(
                    services, mode, dsn, name=name, extra_env=extra_env, wait_ready=False
                )
            )
        await asyncio.gather(*(wait_mode_ready(p, mode) for p in into))

    async def pace(
        self,
        until_ns: int,
        status: Callable[[float], str],
        *,
        alive: Sequence[tuple[Child, str]] = (),
        step: float = 1.0,
    ) -> None:
        """Let time pass until ``until_ns`` (monotonic), showing ``status(seconds left)``; a
        BenchError as soon as one of the ``alive`` processes has exited."""
        while (left := (until_ns - time.monotonic_ns()) / 1e9) > 0:
            for child, what in alive:
                if not child.running():
                    raise BenchError(f"{what} exited ({child.proc.returncode}):\n{child.tail()}")
            self.progress.status(status(left))
            await asyncio.sleep(min(step, left))

    def array_paths(self, stem: str) -> tuple[Path, Path]:
        """Where the writers' and the consumer's per-event arrays of a cell go (in the work
        directory): ``<stem>-gen.bin``, ``<stem>-got.bin``."""
        cells = self.work / "cells"
        cells.mkdir(parents=True, exist_ok=True)
        return cells / f"{stem}-gen.bin", cells / f"{stem}-got.bin"

    async def start_helper(self, name: str, *argv: str, log: str | None = None) -> Child:
        """Start one of the bench's own processes (``python -m bench <argv>``: the consumer,
        the load generator, ...) from the source snapshot, its stdin and stdout piped."""
        return await Child.start(
            name,
            python_argv("-m", "bench", *argv),
            env=child_env(),
            log_path=self.log_path(log or name),
            pipes=True,
            cwd=self.src,
        )

    async def start_consumer(self, bootstrap: str, topic: str, *, name: str) -> Child:
        """Start the latency consumer (``bench/consumer.py``) on ``topic`` and wait (bounded)
        until it is positioned at the end of every partition."""
        consumer = await self.start_helper(name, "_consumer", bootstrap, topic)
        try:
            ready = json.loads(await consumer.read_line(READY_TIMEOUT))
            if not ready.get("ready"):
                raise BenchError(f"{name} did not get ready: {ready}")
        except BaseException:
            await consumer.stop(5)
            raise
        return consumer

    async def collect(
        self, consumer: Child, *, cell: int, expect: int, within: float, out: Path
    ) -> dict[str, Any]:
        """Ask the consumer for ``cell``'s arrivals (waiting up to ``within`` seconds for
        ``expect`` of them); it writes their arrays to ``out`` and answers with counts."""
        cmd = {"cmd": "collect", "cell": cell, "expect": expect, "timeout": within, "out": str(out)}
        await consumer.send_line(json.dumps(cmd))
        answer: dict[str, Any] = json.loads(await consumer.read_line(within + 30))
        return answer

    async def quit_consumer(self, consumer: Child) -> None:
        """End the consumer (its line protocol's quit, then a bounded stop)."""
        with contextlib.suppress(Exception):
            await consumer.send_line(json.dumps({"cmd": "quit"}))
        await consumer.stop(15)

    async def start_loadgen(self, lc: LoadConfig, *, name: str) -> Child:
        """Start the load generator (``bench/loadgen.py``) with ``lc``, its stdin and stdout
        piped (``stop_on_input``, ``announce`` and its summary line)."""
        config_path = Path(lc.out).with_suffix(".config.json")
        lc.save(config_path)
        return await self.start_helper(name, "_loadgen", str(config_path))

    async def start_steady_writers(
        self,
        dsn: str,
        topic: str,
        *,
        rate: float,
        keys: int,
        seconds: float,
        out: Path,
        name: str,
        tables: tuple[str, ...] = (),
        dsns: tuple[str, ...] = (),
    ) -> tuple[Child, int]:
        """Open-loop writers at ``rate`` ev/s over ``keys`` keys (into a random one of
        ``tables`` per event, if given), on a schedule 10 minutes longer than ``seconds``
        (``stop_writers`` ends it); returns them and the schedule's start (monotonic ns)."""
        lc = LoadConfig(
            dsn=dsn,
            topic=topic,
            cell=1,
            rate=rate,
            warmup=0.0,
            duration=seconds + 600.0,
            writers=writers_for(rate),
            out=str(out),
            keys=keys,
            stop_on_input=True,
            announce=True,
            tables=tables,
            dsns=dsns,
        )
        gen = await self.start_loadgen(lc, name=name)
        try:
            t0 = int(json.loads(await gen.read_line(60))["t0"])
        except BaseException:
            await gen.stop(10)
            raise
        return gen, t0

    async def stop_writers(self, gen: Child) -> dict[str, Any]:
        """End steady writers' schedule (their stdin) and return their summary (events sent,
        acked, errors) once they have written their arrays."""
        await gen.send_line("stop")
        summary: dict[str, Any] = json.loads(await gen.read_line(120))
        return summary

    async def collect_writers(
        self, consumer: Child, writers: dict[str, Any], *, label: str, within: float, out: Path
    ) -> dict[str, Any]:
        """Wait (up to ``within`` seconds) until the consumer has every event the writers
        committed; its answer (``collect``)."""
        self.progress.status(f"{label}: waiting for {writers['acked']} events")
        return await self.collect(
            consumer, cell=1, expect=int(writers["acked"]), within=within, out=out
        )

    async def end_cell(
        self,
        record: dict[str, Any],
        *,
        writers: Child | None,
        mode: Child | None,
        consumer: Child,
        arrays: tuple[Path, ...],
    ) -> None:
        """The end of a cell, whatever happened: writers stopped, the mode stopped (its exit
        code in ``record``), the consumer ended, the arrays removed."""
        if writers is not None:
            await writers.stop(10)
        if mode is not None:
            record["exit_code"] = await self.stop(mode)
        await self.quit_consumer(consumer)
        for path in arrays:
            path.unlink(missing_ok=True)

    async def drop_database(self, services: Services, name: str) -> None:
        """Drop a database of the run when its cell is done (a failure is a note: the
        services' end drops or removes it anyway)."""
        try:
            await services.drop_database(name)
        except (OSError, asyncpg.PostgresError, TimeoutError) as e:
            self.notes.append(f"dropping {name}: {type(e).__name__}: {e}")

    async def stop(self, child: Child) -> int | None:
        """A graceful stop (bounded); a note when the exit was not clean."""
        code = await child.stop(_STOP_TIMEOUT)
        if code not in (0, -15):
            self.notes.append(f"{child.name} exited with {code} (log {child.log_path})")
        return code

    async def run(
        self,
        open_services: Callable[[Path], Awaitable[Services]],
        body: Callable[[Services], Awaitable[None]],
        *,
        fsync_seconds: int = 0,
        pgbouncer: bool = False,
    ) -> Path:
        """Open the services (and PgBouncer with ``pgbouncer``), record the environment, run
        ``body``; always write the JSON. BenchError when the bench itself broke."""
        self.result["load_average_start"] = loadavg()
        cpu0 = envinfo.cpu_times()
        t0 = time.monotonic()
        services: Services | None = None
        ok = False
        try:
            self.progress.line(f"bench {self.phase or 'run'}: work dir {self.work}")
            self.progress.status("starting PostgreSQL and Kafka")
            services = await open_services(self.work)
            services.src = self.src
            self.progress.line(
                f"services: {'own devstack (durable)' if services.own_stack else 'given'} "
                f"{services.bootstrap}"
            )
            self.result["environment"] = await record_environment(
                services,
                self.work,
                self.src_digest,
                fsync_seconds=fsync_seconds,
                progress=self.progress,
                notes=self.notes,
                load_average=self.result["load_average_start"],
            )
            label_modes(self.result)  # needs the environment's git record
            if pgbouncer:
                self.progress.status("starting PgBouncer (transaction pooling)")
                pooled = await start_pgbouncer(services)
                self.result["environment"]["pgbouncer"] = pooled
                self.progress.line(f"pgbouncer: {pooled['version']}, port {pooled['port']}")
            else:
                self.result["environment"]["pgbouncer"] = {"ran": False}
            await body(services)
            ok = not self.errors
        except BenchError as e:
            self.errors.append(str(e))
            raise
        finally:
            self.result["load_average_end"] = loadavg()
            self.result["host_cpu_busy"] = envinfo.busy_share(cpu0, envinfo.cpu_times())
            self.result["wall_seconds"] = round(time.monotonic() - t0, 1)
            self.result["finished_utc"] = utc()
            self.result["errors"] = self.errors
            if services is not None:
                record = self.result.get("environment", {}).get("pgbouncer")
                try:
                    if record is not None:
                        record.update(await end_record(services))
                except Exception as e:  # optional; the services must still be stopped
                    self.notes.append(f"PgBouncer end record: {type(e).__name__}: {e}")
                try:
                    await close_services(services)
                except Exception as e:
                    self.errors.append(f"stopping services: {type(e).__name__}: {e}")
            self.write()
            if ok and not self.keep:
                remove_work_dir(self.work)
            else:
                self.progress.line(f"work dir kept: {self.work}")
        if self.errors:
            raise BenchError("; ".join(self.errors[:5]))
        return self.path

    def write(self) -> Path:
        """Write the result JSON (atomically); returns its path."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        # Compact: a run holds per-cell arrays; indented, one run was 370,000 lines.
        tmp.write_text(json.dumps(_clean(self.result), separators=(",", ":")) + "\n")
        tmp.replace(self.path)
        return self.path
