"""What the regimes share: ``Regime`` (the parts a regime module fills in; ``bench.catalog``
lists them), ``RegimeRun`` and ``Cells`` (the skeleton of a run), modes, the join of writers' and
consumer's per-event arrays, latency figures, targets, CPU sampling and ``Looker``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from array import array
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import asyncpg

from bench.config import MODES, POLLER, Mode
from bench.fmt import tables_under
from bench.hist import Histogram
from bench.phase import PhaseRun, loadavg, utc
from bench.procs import BenchError, Child, cluster_cpu_seconds
from bench.revs import with_alt_modes
from bench.services import Services, open_services, postmaster_pid, prepare_mode

DEFAULT_REGIME_MODES = ("notify", "poller")
# What a look at the database may fail with (it is recorded, and the look is skipped).
QUERY_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError)
_LOOK_TIMEOUT = 60.0

Result = dict[str, Any]


@dataclass(frozen=True)
class Regime:
    """A regime of ``python -m bench``: ``name`` is its command, its result's ``phase`` and
    its files' prefix. ``run`` writes the result JSON (even when it fails half-way) and returns
    its path; ``problems`` say what makes a result wrong, not slow; ``plot`` returns False when
    there is nothing to draw; ``terminal``: the report's tables shown at the end of a run."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    configure: Callable[[argparse.Namespace], Any]
    run: Callable[..., Coroutine[Any, Any, Path]]
    summarize: Callable[[Result], Result]
    problems: Callable[[Result], list[str]]
    markdown: Callable[[Result, Result, list[str]], str]
    plot: Callable[[Result, Result, Path], bool]
    terminal: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, module: str, run: Callable[..., Coroutine[Any, Any, Path]], *terminal: str
    ) -> Regime:
        """The regime of a module: its name is the module's with dashes, its parts the
        module's ``HELP``, ``arguments``, ``configure``, ``summarize``, ``problems``,
        ``markdown`` and ``plot``."""
        m = sys.modules[module]
        name = module.rpartition(".")[2].replace("_", "-")
        parts = (m.summarize, m.problems, m.markdown, m.plot)
        return cls(name, m.HELP, m.arguments, m.configure, run, *parts, terminal=terminal)

    def write_report(self, json_path: Path, *, plots: bool = True) -> Path:
        """Write ``<stem>.md`` (and, with ``plots``, ``<stem>.png``) next to a result JSON;
        returns the markdown's path."""
        result = json.loads(json_path.read_text())
        summary = self.summarize(result)
        png = json_path.with_suffix(".png")
        names: list[str] = []
        if plots:
            try:
                if self.plot(result, summary, png):
                    names.append(png.name)
            except ImportError as e:  # matplotlib is optional: the tables do not need it
                result.setdefault("notes", []).append(f"plot skipped: {e}")
        md = json_path.with_suffix(".md")
        md.write_text(self.markdown(result, summary, names))
        return md

    def terminal_lines(self, result: Result) -> list[str]:
        """The report's main tables and targets, for the terminal at the end of a run."""
        if not self.terminal:
            return []
        return tables_under(self.markdown(result, self.summarize(result), []), self.terminal)


class RegimeRun:
    """The run of a regime: ``main`` makes its ``PhaseRun``, prints ``intro`` and runs
    ``body`` on the services ``open_services`` opens."""

    name = ""  # the regime's name: its result's "phase"

    def __init__(self, cfg: Any, run: PhaseRun) -> None:
        self.cfg = cfg
        self.run = run

    def intro(self) -> str:
        """The run's first line: what it will do."""
        raise NotImplementedError

    def pgbouncer(self) -> bool:
        """Whether a mode of the run goes through the bench's PgBouncer."""
        return False

    async def open_services(self, work: Path) -> Services:
        """PostgreSQL and Kafka for the run."""
        return await open_services(work)

    async def body(self, services: Services) -> None:
        """The regime's work."""
        raise NotImplementedError

    @classmethod
    async def main(cls, cfg: Any, out_dir: Path, *, keep: bool) -> Path:
        """Run the regime; returns the result JSON's path (written even on failure)."""
        run = PhaseRun(cls.name, cfg.to_json(), out_dir, keep=keep)
        runner = cls(cfg, run)
        run.progress.line(runner.intro())
        return await run.run(
            runner.open_services,
            runner.body,
            fsync_seconds=cfg.fsync_test_seconds,
            pgbouncer=runner.pgbouncer(),
        )


class _Described(Protocol):
    """A mode as a regime records it: its name and a JSON description."""

    @property
    def name(self) -> str: ...

    def to_json(self) -> dict[str, Any]: ...


M = TypeVar("M", bound=_Described)


class Cells(RegimeRun, Generic[M]):
    """A regime run as cells (``grid``: identity and label of each, round first), each on
    a fresh database and topic, ``prepare`` before the first; the JSON is rewritten after each."""

    short = ""

    def __init__(self, cfg: Any, run: PhaseRun, modes: list[M]) -> None:
        super().__init__(cfg, run)
        self.modes = {m.name: m for m in modes}
        self.cells: list[dict[str, Any]] = []
        self.postmaster: int | None = None  # whose processes are the database's CPU
        run.progress.total = len(list(self.grid()))
        run.result["modes"] = {m.name: m.to_json() for m in modes}
        run.result["cells"] = self.cells

    def grid(self) -> Iterator[tuple[dict[str, Any], str]]:
        """Every cell's identity (recorded in it) and label (its progress lines), in order."""
        raise NotImplementedError

    async def prepare(self, services: Services) -> None:
        """Before the first cell (nothing by default)."""

    async def cell(
        self, services: Services, identity: dict[str, Any], label: str
    ) -> dict[str, Any]:
        """Measure one cell; its record."""
        raise NotImplementedError

    async def body(self, services: Services) -> None:
        await self.prepare(services)
        for identity, label in self.grid():
            await add_cell(
                self.run, self.cells, identity, label, self.cell(services, identity, label)
            )

    def names(self, cell: dict[str, Any]) -> tuple[str, str]:
        """The database and the topic of a cell."""
        at = f"{self.run.run_id.lower()}_{cell['cell']}"
        return f"bench_{self.short}_{at}", f"bench-{self.short}-{at.replace('_', '-')}"

    async def in_fresh_database(
        self,
        services: Services,
        mode: Mode,
        cell: dict[str, Any],
        measure: Callable[[str], Awaitable[None]],
    ) -> None:
        """``measure(dsn)`` on a fresh database and topic for ``mode`` (the cell's
        ``database_setup``), the database dropped afterwards whatever happened."""
        database, topic = self.names(cell)
        await in_fresh_database(
            self.run,
            services,
            mode,
            cell,
            database=database,
            topic=topic,
            partitions=self.cfg.partitions,
            measure=measure,
        )


def regime_mode(name: str, alt_tree: str | None) -> Mode:
    """``notify`` (the relay, default settings), ``notify-alt`` (from the ``--alt-relay``
    tree) or ``poller`` (the drain phase's plain poller)."""
    if name == "notify":
        return MODES["notify"]
    if name == "notify-alt":
        if alt_tree is None:
            raise BenchError("mode notify-alt needs --alt-relay DIR")
        return MODES["notify"].from_tree(alt_tree)
    if name == "poller":
        return POLLER
    raise BenchError(f"unknown mode {name!r}: notify, notify-alt (with --alt-relay) or poller")


def regime_modes(args: argparse.Namespace, alt_tree: str | None) -> list[str]:
    """``--modes`` of held-snapshot or failing-head, without repeats, with ``notify-alt``
    after ``notify`` for ``--compare-rev``, each checked; and ``--repeat`` checked."""
    modes = list(dict.fromkeys(args.modes))
    if args.alt_revision:
        modes = with_alt_modes(modes, lambda m: "notify-alt" if m == "notify" else None)
    for m in modes:
        regime_mode(m, alt_tree)  # fails early on a bad name
    if args.repeat < 1:
        raise BenchError("--repeat must be at least 1")
    return modes


def target(what: str, measured: str, met: bool) -> dict[str, str]:
    """One of a summary's targets: what it asks, what was measured, and the verdict."""
    return {"target": what, "measured": measured, "verdict": "met" if met else "MISSED"}


def received_at(got: dict[str, array[int]]) -> dict[int, int]:
    """Event index -> its first receipt (monotonic ns), from the consumer's arrays."""
    out: dict[int, int] = {}
    for i, r in zip(got["index"], got["recv"], strict=True):
        out.setdefault(int(i), int(r))
    return out


def acked_events(ack: array[int], recv_of: dict[int, int]) -> Iterator[tuple[int, int, int | None]]:
    """(index, commit ack, first receipt or None) of every event the writers committed."""
    for i, a in enumerate(ack):
        if a:
            yield i, a, recv_of.get(i)


def event_counts(ack: array[int], recv_of: dict[int, int]) -> dict[str, int]:
    """Events committed, received, and committed but never received."""
    acked = received = 0
    for _, _, r in acked_events(ack, recv_of):
        acked += 1
        received += r is not None
    return {"acked": acked, "received": received, "missing": acked - received}


def latency_ms(h: Histogram) -> dict[str, float | None]:
    """count, p50, p99 and max of a histogram, in milliseconds (None when empty)."""
    if h.count == 0:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    return {
        "count": h.count,
        "p50": h.value_at(50.0) / 1000.0,
        "p99": h.value_at(99.0) / 1000.0,
        "max": h.max_us / 1000.0,
    }


class CpuMeter:
    """CPU seconds of the mode's processes and of the PostgreSQL cluster (every process of its
    postmaster, from /proc; None when the server's processes are not visible here)."""

    def __init__(self, procs: list[Child], postmaster: int | None) -> None:
        self.procs = procs
        self.postmaster = postmaster

    def read(self) -> tuple[float, float | None]:
        """(mode CPU seconds, database CPU seconds)."""
        db = cluster_cpu_seconds(self.postmaster) if self.postmaster is not None else None
        return sum(p.cpu() for p in self.procs), db


async def database_postmaster(services: Services, run: PhaseRun) -> int | None:
    """The postmaster whose processes' CPU is "the database's" (recorded; a note when it is
    not visible, or when it is not the bench's own server)."""
    pid = await postmaster_pid(services.dsn)
    run.result["postmaster_pid"] = pid
    if pid is None:
        run.notes.append(
            "the PostgreSQL server's processes are not visible on this host: no database CPU"
        )
    elif not services.own_stack:
        run.notes.append(
            "database CPU is the whole cluster's: with given services, other databases' work "
            "counts too"
        )
    return pid


async def add_cell(
    run: PhaseRun,
    cells: list[dict[str, Any]],
    identity: dict[str, Any],
    label: str,
    measure: Awaitable[dict[str, Any]],
) -> None:
    """Run one cell and append its record, or its error (the other cells still run); the
    JSON is rewritten after every cell, so a stopped run keeps what it has."""
    try:
        cell = await measure
    except BenchError as e:
        cell = {"cell": len(cells) + 1, **identity, "error": str(e)}
        run.errors.append(f"{label}: {e}")
        run.progress.line(f"{label}: FAILED: {e}", cell=True)
    cells.append(cell)
    run.write()


def cell_record(n: int, **identity: Any) -> dict[str, Any]:
    """The start of a cell's record: its number, what it is (round, mode, ...), when it
    started and the load average then."""
    return {"cell": n, **identity, "started_utc": utc(), "load_average_start": loadavg()}


async def in_fresh_database(
    run: PhaseRun,
    services: Services,
    mode: Mode,
    cell: dict[str, Any],
    *,
    database: str,
    topic: str,
    partitions: int,
    measure: Callable[[str], Awaitable[None]],
) -> None:
    """``measure(dsn)`` on a fresh database and topic for ``mode`` (the cell's
    ``database_setup``), the database dropped afterwards whatever happened."""
    try:
        dsn, cell["database_setup"] = await prepare_mode(
            services, mode, database, topic, partitions=partitions
        )
        await measure(dsn)
    finally:
        await run.drop_database(services, database)


async def warm_up(
    run: PhaseRun,
    services: Services,
    *,
    seconds: float,
    rate: float,
    keys: int,
    partitions: int,
) -> dict[str, Any]:
    """Load the stack through the relay before the first measured cell, figures thrown
    away: a fresh stack answers slowly for its first minute under load (the broker's JVM; on
    2026-11-27 the first 10 s window's p99 was 186 ms in round 1, 25 ms in round 2), and the
    run's first mode paid for it alone. Returns the result's ``warmup`` record."""
    mode = regime_mode("notify", None)
    database = f"bench_warmup_{run.run_id.lower()}"
    topic = f"bench-warmup-{run.run_id.lower()}"
    record: dict[str, Any] = {"seconds": seconds, "rate": rate, "keys": keys, "mode": mode.name}
    gen_path, _ = run.array_paths("warmup")

    async def load(dsn: str) -> None:
        consumer = await run.start_consumer(services.bootstrap, topic, name="consumer-warmup")
        proc: Child | None = None
        gen: Child | None = None
        try:
            proc = await run.start(services, mode, dsn, name="relay-warmup")
            gen, _ = await run.start_steady_writers(
                dsn,
                topic,
                rate=rate,
                keys=keys,
                seconds=seconds,
                out=gen_path,
                name="writers-warmup",
            )
            await run.pace(
                time.monotonic_ns() + int(seconds * 1e9),
                lambda left: f"warm-up: {seconds - left:.0f}/{seconds:g}s",
                alive=[(gen, "warm-up writers")],
            )
            record["writers"] = await run.stop_writers(gen)
            gen = None
        finally:
            await run.end_cell(
                record, writers=gen, mode=proc, consumer=consumer, arrays=(gen_path,)
            )

    await in_fresh_database(
        run,
        services,
        mode,
        record,  # its database_setup too
        database=database,
        topic=topic,
        partitions=partitions,
        measure=load,
    )
    run.progress.line(
        f"warm-up: {seconds:g} s at {rate:g} ev/s through the relay (not measured), "
        f"{record.get('writers', {}).get('acked', '?')} events"
    )
    return record


def unfinished(cell: dict[str, Any], where: str, needs: str) -> list[str]:
    """The problem of a cell that failed or has no ``needs`` (its analysis)."""
    if "error" in cell or needs not in cell:
        return [f"{where}: did not finish: {cell.get('error', 'no analysis')}"]
    return []


class Looker:
    """Looks at a database every ``every`` seconds on a connection of its own (named
    ``application_name``), paced from the start so slow looks do not drift; a subclass's
    ``look()`` takes one (under ``lock`` when the bench calls it too); ``fetch`` records a
    failed query in ``errors`` and returns None."""

    def __init__(self, dsn: str, every: float, application_name: str) -> None:
        self.dsn = dsn
        self.every = every
        self.application_name = application_name
        self.errors: list[str] = []
        self.lock = asyncio.Lock()
        self._conn: asyncpg.Connection | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect, take the first look, then look in the background."""
        self._conn = await asyncpg.connect(
            self.dsn, timeout=30, server_settings={"application_name": self.application_name}
        )
        await self.prepare()
        await self.look()
        self._task = asyncio.create_task(self._loop())

    async def prepare(self) -> None:
        """Once connected, before the first look (nothing by default)."""

    async def look(self) -> object:
        """One look (by the subclass)."""
        raise NotImplementedError

    async def _loop(self) -> None:
        due = time.monotonic()
        while True:
            due += self.every
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            await self.look()

    async def fetch(
        self, sql: str, *args: object, within: float = _LOOK_TIMEOUT
    ) -> list[asyncpg.Record] | None:
        """The rows of one query on the looker's connection (failing after ``within``
        seconds); None if it failed."""
        assert self._conn is not None, "start() first"
        try:
            rows: list[asyncpg.Record] = await self._conn.fetch(sql, *args, timeout=within)
        except QUERY_ERRORS as e:
            if len(self.errors) < 5:
                self.errors.append(f"{type(e).__name__}: {e}")
            return None
        return rows

    async def stop(self) -> None:
        """Stop looking and close the connection (bounded); may be called again."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close(timeout=5)
