"""The held-snapshot regime (``python -m bench held-snapshot``): steady writers while another
session holds a REPEATABLE READ snapshot open; latency, rate, CPU per event and dead tuples per
window. Method: ``bench/README.md``, "Held snapshot"."""

from __future__ import annotations

import argparse
import bisect
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from bench import envinfo
from bench.analysis import median
from bench.arrays import load_arrays
from bench.config import (
    Mode,
    PhaseConfig,
    add_options,
    common_options,
    from_args,
    phase_options,
    regime_options,
)
from bench.fmt import (
    environment_lines,
    finish,
    modes_section,
    ms,
    num,
    opt,
    percent,
    table,
    targets_section,
    whole,
)
from bench.hist import Histogram
from bench.phase import PhaseRun, loadavg
from bench.procs import BenchError, Child
from bench.regimes import (
    DEFAULT_REGIME_MODES,
    Cells,
    CpuMeter,
    Looker,
    Regime,
    acked_events,
    cell_record,
    database_postmaster,
    event_counts,
    latency_ms,
    received_at,
    regime_mode,
    regime_modes,
    target,
    unfinished,
    warm_up,
)
from bench.services import Services

PHASES = ("baseline", "hold", "recovery")
_QUERY_TIMEOUT = 60.0
_STATS = """
SELECT n_dead_tup, n_live_tup, autovacuum_count, pg_relation_size(relid) AS heap_bytes,
       pg_total_relation_size(relid) AS total_bytes
FROM pg_stat_user_tables WHERE relname = 'outbox'
"""


@dataclass
class HeldSnapshotConfig(PhaseConfig):
    """Everything one held-snapshot run does; recorded in the result JSON."""

    rate: float = 800.0
    keys: int = 40
    baseline: float = 60.0
    hold: float = 600.0
    recovery: float = 60.0
    window: float = 30.0
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_REGIME_MODES))
    repeat: int = 1
    sample_every: float = 1.0
    drain_timeout: float = 120.0  # after the load: until every committed event arrived
    warmup: float = 60.0  # seconds of unmeasured load on the stack before the first cell

    def phase_windows(self) -> list[tuple[str, float]]:
        """(phase, offset) of every window: each phase cut into ``window`` pieces, a
        remainder under half a window joined to the piece before it."""
        out: list[tuple[str, float]] = []
        for phase, length in zip(PHASES, (self.baseline, self.hold, self.recovery), strict=True):
            offsets = [0.0]
            while length - offsets[-1] - self.window >= self.window / 2:
                offsets.append(offsets[-1] + self.window)
            out += [(phase, o) for o in offsets]
        return out


HELP = "steady load while another session holds a REPEATABLE READ snapshot open"


def arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m bench held-snapshot``."""
    add_options(
        p,
        HeldSnapshotConfig,
        rate="writers' events/s (default 800)",
        keys="distinct keys (default 40)",
        baseline="seconds before the snapshot",
        hold="seconds the snapshot is held (default 600)",
        recovery="seconds after the rollback",
        window="seconds per report window",
        warmup="seconds of unmeasured load through the relay before the first cell, so that "
        "no mode meets a cold stack (default 60; 0: none)",
        drain_timeout="after the load, seconds to wait for every committed event",
    )
    regime_options(p)
    phase_options(p)


def configure(args: argparse.Namespace) -> HeldSnapshotConfig:
    """The config of ``python -m bench held-snapshot ...`` (a BenchError for a bad value)."""
    common = common_options(args)
    modes = regime_modes(args, common["alt_relay"])
    if min(args.baseline, args.hold, args.recovery, args.window) <= 0 or args.rate <= 0:
        raise BenchError("--rate, --baseline, --hold, --recovery and --window must be > 0")
    if args.warmup < 0:
        raise BenchError("--warmup must be >= 0")
    return from_args(HeldSnapshotConfig, args, modes=modes, **common)


@dataclass
class _Sample:
    t: int  # monotonic ns
    mode_cpu: float
    db_cpu: float | None
    dead: int | None = None
    live: int | None = None
    autovacuums: int | None = None
    heap_bytes: int | None = None
    total_bytes: int | None = None


class _Sampler(Looker):
    """Every ``every`` seconds: the mode's CPU, the cluster's CPU, and the outbox's
    ``pg_stat_user_tables`` figures and size, on one connection to the mode's database."""

    def __init__(self, dsn: str, meter: CpuMeter, every: float) -> None:
        super().__init__(dsn, every, "bench-sampler")
        self.meter = meter
        self.samples: list[_Sample] = []

    async def look(self) -> _Sample:
        """Take one sample now."""
        async with self.lock:  # the loop and the bench's own calls share one connection
            mode_cpu, db_cpu = self.meter.read()
            rows = await self.fetch(_STATS, within=_QUERY_TIMEOUT)
            s = _Sample(time.monotonic_ns(), mode_cpu, db_cpu)
            if rows:
                row = rows[0]
                s.dead, s.live = row["n_dead_tup"], row["n_live_tup"]
                s.autovacuums = row["autovacuum_count"]
                s.heap_bytes, s.total_bytes = row["heap_bytes"], row["total_bytes"]
            self.samples.append(s)
            return s

    def cpu_at(self, t: int) -> tuple[float | None, float | None]:
        """(mode, database) CPU seconds at ``t``, linear between the samples around it."""
        ss = self.samples
        if not ss or t < ss[0].t or t > ss[-1].t:
            return None, None
        k = bisect.bisect_left([s.t for s in ss], t)
        if ss[k].t == t or k == 0:
            return ss[k].mode_cpu, ss[k].db_cpu
        a, b = ss[k - 1], ss[k]
        f = (t - a.t) / (b.t - a.t)
        mode = a.mode_cpu + f * (b.mode_cpu - a.mode_cpu)
        db = (
            a.db_cpu + f * (b.db_cpu - a.db_cpu)
            if a.db_cpu is not None and b.db_cpu is not None
            else None
        )
        return mode, db

    def last_before(self, t: int) -> _Sample | None:
        """The last sample taken at or before ``t``."""
        best = None
        for s in self.samples:
            if s.t > t:
                break
            best = s
        return best


def _windows(
    cfg: HeldSnapshotConfig, bounds: dict[str, tuple[int, int]]
) -> list[tuple[str, int, int]]:
    """(phase, start ns, end ns) of every window, from each phase's actual start and end."""
    plan = cfg.phase_windows()
    out = []
    for k, (phase, offset) in enumerate(plan):
        start, end = bounds[phase]
        w0 = start + int(offset * 1e9)
        nxt = plan[k + 1] if k + 1 < len(plan) else None
        w1 = start + int(nxt[1] * 1e9) if nxt is not None and nxt[0] == phase else end
        out.append((phase, w0, w1))
    return out


def analyse_cell(
    cfg: HeldSnapshotConfig,
    gen: dict[str, Any],
    got: dict[str, Any],
    sampler: _Sampler,
    bounds: dict[str, tuple[int, int]],
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, int]]:
    """Per window: commits, achieved rate, ack -> receive latency, CPU per event, dead
    tuples; per phase: the latency of all its events pooled; and the event totals."""
    wins = _windows(cfg, bounds)
    edges = [w[1] for w in wins] + [wins[-1][2]]
    n = len(wins)
    committed = [0] * n
    delivered = [0] * n
    missing = [0] * n
    ack_hist = [Histogram() for _ in range(n)]
    e2e_hist = [Histogram() for _ in range(n)]
    phase_hist = {p: Histogram() for p in PHASES}
    recv_of = received_at(got)
    sched = gen["sched"]
    for i, a, r in acked_events(gen["ack"], recv_of):
        k = bisect.bisect_right(edges, a) - 1
        if k < 0 or k >= n:
            continue
        committed[k] += 1
        if r is None:
            missing[k] += 1
            continue
        ack_hist[k].record((r - a) // 1000)
        e2e_hist[k].record((r - sched[i]) // 1000)
        phase_hist[wins[k][0]].record((r - a) // 1000)
    for r in recv_of.values():
        k = bisect.bisect_right(edges, r) - 1
        if 0 <= k < n:
            delivered[k] += 1
    t_start = bounds["baseline"][0]
    windows = []
    for k, (phase, w0, w1) in enumerate(wins):
        seconds = (w1 - w0) / 1e9
        m0, d0 = sampler.cpu_at(w0)
        m1, d1 = sampler.cpu_at(w1)
        mode_cpu = m1 - m0 if m0 is not None and m1 is not None else None
        db_cpu = d1 - d0 if d0 is not None and d1 is not None else None
        end = sampler.last_before(w1)
        start = sampler.last_before(w0)
        windows.append(
            {
                "window": k,
                "phase": phase,
                "start_s": round((w0 - t_start) / 1e9, 3),
                "seconds": round(seconds, 3),
                "committed": committed[k],
                "rate": committed[k] / seconds if seconds > 0 else None,
                "rate_share": committed[k] / (cfg.rate * seconds) if seconds > 0 else None,
                "delivered": delivered[k],
                "missing": missing[k],
                "ack_to_recv": latency_ms(ack_hist[k]),
                "e2e_p99": latency_ms(e2e_hist[k])["p99"],
                "mode_cpu_percent": 100 * mode_cpu / seconds if mode_cpu is not None else None,
                "mode_cpu_us_per_event": (
                    1e6 * mode_cpu / delivered[k] if mode_cpu is not None and delivered[k] else None
                ),
                "db_cpu_percent": 100 * db_cpu / seconds if db_cpu is not None else None,
                "db_cpu_us_per_event": (
                    1e6 * db_cpu / committed[k] if db_cpu is not None and committed[k] else None
                ),
                "dead_tuples": end.dead if end else None,
                "live_tuples": end.live if end else None,
                "heap_bytes": end.heap_bytes if end else None,
                "total_bytes": end.total_bytes if end else None,
                "autovacuums": (
                    end.autovacuums - start.autovacuums
                    if end
                    and start
                    and end.autovacuums is not None
                    and start.autovacuums is not None
                    else None
                ),
            }
        )
    phases = {p: latency_ms(h) for p, h in phase_hist.items()}
    return windows, phases, event_counts(gen["ack"], recv_of)


class _HeldSnapshot(Cells[Mode]):
    name, short = "held-snapshot", "held"
    cfg: HeldSnapshotConfig

    def __init__(self, cfg: HeldSnapshotConfig, run: PhaseRun) -> None:
        super().__init__(cfg, run, [regime_mode(m, cfg.alt_relay) for m in cfg.modes])

    def intro(self) -> str:
        cfg = self.cfg
        return (
            f"held-snapshot: {' '.join(cfg.modes)} x {cfg.repeat} round(s): {cfg.rate:g} ev/s "
            f"over {cfg.keys} keys, baseline {cfg.baseline:g}s, snapshot held {cfg.hold:g}s, "
            f"recovery {cfg.recovery:g}s, windows of {cfg.window:g}s"
        )

    def grid(self) -> Iterator[tuple[dict[str, Any], str]]:
        for rnd in range(self.cfg.repeat):
            for mode in self.modes:
                yield {"round": rnd, "mode": mode}, f"{mode} round {rnd + 1}"

    async def prepare(self, services: Services) -> None:
        self.postmaster = await database_postmaster(services, self.run)
        if self.cfg.warmup > 0:
            cfg = self.cfg
            self.run.result["warmup"] = await warm_up(
                self.run,
                services,
                seconds=cfg.warmup,
                rate=cfg.rate,
                keys=cfg.keys,
                partitions=cfg.partitions,
            )

    async def cell(
        self, services: Services, identity: dict[str, Any], label: str
    ) -> dict[str, Any]:
        run = self.run
        mode = self.modes[identity["mode"]]
        cell = cell_record(len(self.cells) + 1, **identity)
        topic = self.names(cell)[1]
        run.progress.status(f"{label}: database and topic")
        await self.in_fresh_database(
            services,
            mode,
            cell,
            lambda dsn: self._measure(services, mode, dsn, topic, cell, label),
        )
        hold = [w for w in cell["windows"] if w["phase"] == "hold"]
        worst = max((w["ack_to_recv"]["p99"] or 0.0 for w in hold), default=0.0)
        share = min((w["rate_share"] or 0.0 for w in hold), default=0.0)
        base = cell["phases"]["baseline"]["p99"]
        lost = cell["events"]["acked"] - cell["events"]["received"]
        run.progress.line(
            f"{label:<22} baseline p99 {ms(base)}, worst hold window p99 {ms(worst)}, "
            f"lowest hold rate share {100 * share:.0f}%, dead tuples at release "
            f"{cell.get('dead_tuples_at_release')}, {lost} missing",
            cell=True,
        )
        for line in window_table({mode.name: cell["windows"]}):
            run.progress.line(f"  {line}")
        return cell

    async def _measure(
        self, services: Services, mode: Mode, dsn: str, topic: str, cell: dict[str, Any], label: str
    ) -> None:
        run, cfg = self.run, self.cfg
        gen_path, got_path = run.array_paths(f"held-{cell['cell']}")
        consumer = await run.start_consumer(services.bootstrap, topic, name=f"consumer-{label}")
        proc: Child | None = None
        gen: Child | None = None
        sampler: _Sampler | None = None
        holder: asyncpg.Connection | None = None
        host0 = envinfo.cpu_times()
        try:
            extra = cfg.relay_env if mode.kind == "relay" else {}
            proc = await run.start(
                services, mode, dsn, name=f"{mode.name}-{label}", extra_env=extra
            )
            sampler = _Sampler(dsn, CpuMeter([proc], self.postmaster), cfg.sample_every)
            await sampler.start()
            gen, t0 = await run.start_steady_writers(
                dsn,
                topic,
                rate=cfg.rate,
                keys=cfg.keys,
                seconds=cfg.baseline + cfg.hold + cfg.recovery,
                out=gen_path,
                name=f"writers-{label}",
            )
            await self._phase(label, "baseline", t0, cfg.baseline, sampler, gen)
            # The snapshot: taken by the first statement of the REPEATABLE READ transaction.
            holder = await asyncpg.connect(
                dsn, timeout=30, server_settings={"application_name": "bench-snapshot"}
            )
            t_hold = time.monotonic_ns()
            await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            cell["snapshot_count"] = int(
                await holder.fetchval("SELECT count(*) FROM outbox", timeout=_QUERY_TIMEOUT)
            )
            cell["snapshot_count_s"] = (time.monotonic_ns() - t_hold) / 1e9
            await self._phase(label, "hold", t_hold, cfg.hold, sampler, gen)
            await holder.execute("ROLLBACK")
            t_release = time.monotonic_ns()
            await holder.close(timeout=5)
            holder = None
            at_release = await sampler.look()
            cell["dead_tuples_at_release"] = at_release.dead
            await self._phase(label, "recovery", t_release, cfg.recovery, sampler, gen)
            t_end = time.monotonic_ns()
            cell["writers"] = await run.stop_writers(gen)
            await sampler.look()
            cell["consumer"] = await run.collect_writers(
                consumer, cell["writers"], label=label, within=cfg.drain_timeout, out=got_path
            )
            await sampler.look()
            host1 = envinfo.cpu_times()
            bounds = {
                "baseline": (t0, t_hold),
                "hold": (t_hold, t_release),
                "recovery": (t_release, t_end),
            }
            cell["phase_seconds"] = {p: (b - a) / 1e9 for p, (a, b) in bounds.items()}
            windows, phases, events = analyse_cell(
                cfg, load_arrays(gen_path), load_arrays(got_path), sampler, bounds
            )
            cell.update(
                {
                    "windows": windows,
                    "phases": phases,
                    "events": events,
                    "sampler_errors": sampler.errors,
                    "host_cpu_busy": envinfo.busy_share(host0, host1),
                    "load_average_end": loadavg(),
                }
            )
        finally:
            if holder is not None:
                with contextlib.suppress(Exception):
                    await holder.close(timeout=5)
            if sampler is not None:
                await sampler.stop()
            await run.end_cell(
                cell, writers=gen, mode=proc, consumer=consumer, arrays=(gen_path, got_path)
            )

    async def _phase(
        self, label: str, phase: str, start: int, seconds: float, sampler: _Sampler, gen: Child
    ) -> None:
        """Pace one phase (the schedule is the writers'; this only waits), with a progress
        line at the end of every window."""
        ends = [o for p, o in self.cfg.phase_windows() if p == phase][1:]
        plan = [*ends, seconds]

        def status(_: float) -> str:
            last = sampler.samples[-1] if sampler.samples else None
            elapsed = (time.monotonic_ns() - start) / 1e9
            dead = f", dead tuples {last.dead}" if last else ""
            return f"{label}: {phase} {elapsed:.0f}/{seconds:g}s{dead}"

        for offset in plan:
            await self.run.pace(start + int(offset * 1e9), status, alive=[(gen, "the writers")])
            s = sampler.samples[-1] if sampler.samples else None
            mb = f"{s.total_bytes / 2**20:.1f} MB" if s and s.total_bytes is not None else "-"
            self.run.progress.line(
                f"{label}: {phase} {offset:.0f}s of {seconds:g}s: dead tuples "
                f"{s.dead if s else '-'}, outbox {mb}"
            )


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds per mode and window, per phase, and the targets
    (design/benchmarks.md)."""
    cfg = result["config"]
    modes: dict[str, Any] = {}
    targets: list[dict[str, Any]] = []
    for mode in cfg["modes"]:
        cells = [c for c in result.get("cells", []) if c["mode"] == mode and "windows" in c]
        if not cells:
            continue
        count = min(len(c["windows"]) for c in cells)
        windows = []
        for k in range(count):
            ws = [c["windows"][k] for c in cells]
            windows.append(
                {
                    "window": k,
                    "phase": ws[0]["phase"],
                    "start_s": median(w["start_s"] for w in ws),
                    "seconds": median(w["seconds"] for w in ws),
                    "p50": median(w["ack_to_recv"]["p50"] for w in ws),
                    "p99": median(w["ack_to_recv"]["p99"] for w in ws),
                    "max": median(w["ack_to_recv"]["max"] for w in ws),
                    "missing": sum(int(w["missing"]) for w in ws),
                    **{
                        k2: median(w[k2] for w in ws)
                        for k2 in (
                            "rate",
                            "rate_share",
                            "e2e_p99",
                            "mode_cpu_us_per_event",
                            "db_cpu_us_per_event",
                            "mode_cpu_percent",
                            "db_cpu_percent",
                            "dead_tuples",
                            "total_bytes",
                        )
                    },
                }
            )
        phases = {
            p: {k2: median(c["phases"][p][k2] for c in cells) for k2 in ("p50", "p99", "max")}
            for p in PHASES
        }
        hold = [w for w in windows if w["phase"] == "hold"]
        worst_p99 = max((w["p99"] for w in hold if w["p99"] is not None), default=None)
        low_share = min(
            (w["rate_share"] for w in hold if w["rate_share"] is not None), default=None
        )
        base = phases["baseline"]["p99"]
        modes[mode] = {
            "rounds": len(cells),
            "windows": windows,
            "phases": phases,
            "worst_hold_p99": worst_p99,
            "lowest_hold_share": low_share,
            "dead_tuples_at_release": median(c.get("dead_tuples_at_release") for c in cells),
            "missing": sum(c["events"]["acked"] - c["events"]["received"] for c in cells),
        }
        if base is not None and worst_p99 is not None:
            limit = max(2 * base, base + 10.0)
            targets.append(
                target(
                    f"{mode}: every hold window's p99 within max(2x, +10 ms) of the baseline's",
                    f"worst {worst_p99:.1f} ms vs baseline {base:.1f} ms (limit {limit:.1f} ms)",
                    worst_p99 <= limit,
                )
            )
        if low_share is not None:
            targets.append(
                target(
                    f"{mode}: producers keep >= 90% of their rate in every hold window",
                    f"lowest {100 * low_share:.1f}% "
                    f"({low_share * cfg['rate']:.0f} of {cfg['rate']:g} ev/s)",
                    low_share >= 0.9,
                )
            )
    targets += _flat_and_beaten(modes)
    return {"modes": modes, "targets": targets}


# How much a hold window's CPU per event may exceed the baseline's and still count as flat:
# on this shared 2-core host, the same steady load's windows differ by about that much.
_FLAT = 1.25


def _flat_and_beaten(modes: dict[str, Any]) -> list[dict[str, Any]]:
    """Targets of issue #17: CPU per event flat across the hold (each hold window
    within ``_FLAT`` x the baseline's median), and the relay's p99 below the poller's in every
    window."""
    out: list[dict[str, Any]] = []
    for mode, m in modes.items():
        if mode == "poller":
            continue
        base = [w for w in m["windows"] if w["phase"] == "baseline"]
        hold = [w for w in m["windows"] if w["phase"] == "hold"]
        for key, who in (("mode_cpu_us_per_event", "relay"), ("db_cpu_us_per_event", "database")):
            ref = median(w[key] for w in base if w[key] is not None) if base else None
            worst = max((w[key] for w in hold if w[key] is not None), default=None)
            if ref is None or worst is None:
                continue
            out.append(
                target(
                    f"{mode}: {who} CPU per event flat across the hold (every hold "
                    f"window <= {_FLAT:g}x the baseline's)",
                    f"worst {worst:.0f} vs baseline {ref:.0f} µs/event ({worst / ref:.2f}x)",
                    worst <= _FLAT * ref,
                )
            )
        poller = modes.get("poller")
        if poller is None:
            continue
        pairs = [
            (w, p)
            for w, p in zip(m["windows"], poller["windows"], strict=False)
            if w["p99"] is not None and p["p99"] is not None
        ]
        lost = [
            f"{w['phase']} {w['start_s']:.0f} s ({w['p99']:.1f} vs {p['p99']:.1f} ms)"
            for w, p in pairs
            if w["p99"] >= p["p99"]
        ]
        out.append(
            target(
                f"{mode}: p99 below the plain poller's in every window",
                f"below in {len(pairs) - len(lost)} of {len(pairs)} windows"
                + (f"; not in {', '.join(lost)}" if lost else ""),
                bool(pairs) and not lost,
            )
        )
    return out


def window_table(by_mode: dict[str, list[dict[str, Any]]]) -> list[str]:
    """A markdown table of windows (rows) x modes (p50/p99 ms, rate share, mode and database
    CPU µs per event, dead tuples), from per-round windows or medians."""
    modes = list(by_mode)
    head = ["window", "phase"]
    for m in modes:
        head += [f"{m} p50/p99 ms", "rate %", "mode µs/ev", "db µs/ev", "dead tuples"]
    first = by_mode[modes[0]]
    rows = []
    for k, w0 in enumerate(first):
        row = [f"{w0['start_s']:.0f}-{w0['start_s'] + w0['seconds']:.0f} s", w0["phase"]]
        for m in modes:
            ws = by_mode[m]
            if k >= len(ws):
                row += ["-"] * 5
                continue
            w = ws[k]
            lat = w.get("ack_to_recv", w)
            row += [
                f"{opt(lat['p50'], '.1f')} / {opt(lat['p99'], '.1f')}",
                opt(100 * w["rate_share"] if w["rate_share"] is not None else None, ".0f"),
                opt(w["mode_cpu_us_per_event"], ".0f"),
                opt(w["db_cpu_us_per_event"], ".0f"),
                opt(w["dead_tuples"], ".0f"),
            ]
        rows.append(row)
    return table(head, rows)


def problems(result: dict[str, Any]) -> list[str]:
    """What makes a held-snapshot result wrong (not slow): a cell that failed, events that
    never arrived."""
    problems = []
    for c in result.get("cells", []):
        where = f"cell {c['cell']} ({c['mode']}, round {c['round'] + 1})"
        if bad := unfinished(c, where, "events"):
            problems += bad
            continue
        lost = c["events"]["acked"] - c["events"]["received"]
        if lost:
            problems.append(f"{where}: {lost} committed events never arrived")
    return problems


def markdown(result: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    cfg = result["config"]
    lines = [f"# notify-outbox held snapshot {result['run_id']}", ""]
    lines += environment_lines(result)
    lines += [
        f"- writers: {cfg['rate']:g} ev/s, open loop, single-row transactions, {cfg['keys']} "
        f"keys; {cfg['baseline']:g} s baseline, then a REPEATABLE READ transaction (`SELECT "
        f"count(*) FROM outbox`) held open for {cfg['hold']:g} s, then {cfg['recovery']:g} s "
        f"of recovery; {cfg['repeat']} round(s), modes one after the other per round on fresh "
        "databases and topics, medians over rounds",
        "- warm-up: "
        + (
            f"{cfg['warmup']:g} s at the same rate through the relay before the first cell, not "
            "measured (a fresh stack is slow for its first minute under load)"
            if cfg.get("warmup")
            else "none: the first cell met a cold stack"
        ),
        "",
        "Events go into windows by their commit ack. **p50/p99** is commit ack -> consumer "
        "receipt (ms); **rate %** the commits in the window as a share of the offered rate; "
        "**mode µs/ev** the mode process's CPU (user + system) per event delivered in the "
        "window; **db µs/ev** the CPU of every process of the PostgreSQL cluster per event "
        "committed in the window; **dead tuples** the outbox's `n_dead_tup` at the window's end.",
    ]
    lines += targets_section(summary, "design/benchmarks.md")
    lines += ["", "## Per phase (all events of a phase pooled; medians over rounds)", ""]
    lines += table(
        (
            "mode | baseline p50 / p99 / max (ms) | hold | recovery | worst hold window p99 | "
            "lowest hold rate % | dead tuples at release | missing"
        ),
        [
            [
                mode,
                *(
                    " / ".join(num(m["phases"][p][k], 1) for k in ("p50", "p99", "max"))
                    for p in ("baseline", "hold", "recovery")
                ),
                num(m["worst_hold_p99"], 1),
                num(percent(m["lowest_hold_share"]), 1),
                whole(m["dead_tuples_at_release"]),
                str(m["missing"]),
            ]
            for mode, m in summary["modes"].items()
        ],
    )
    if summary["modes"]:
        lines += ["", "## Per window (medians over rounds)", ""]
        lines += window_table({mode: m["windows"] for mode, m in summary["modes"].items()})
        lines += [
            "",
            "More per window: committed ev/s, e2e p99 (from the schedule, ms), mode "
            "and database CPU %, outbox size with its indexes (MB).",
            "",
        ]
        lines += table(
            "window | mode | committed ev/s | e2e p99 | mode CPU % | db CPU % | outbox MB",
            [
                [
                    f"{w['start_s']:.0f} s ({w['phase']})",
                    mode,
                    whole(w["rate"]),
                    num(w["e2e_p99"], 1),
                    num(w["mode_cpu_percent"], 1),
                    num(w["db_cpu_percent"], 1),
                    num(w["total_bytes"] / 2**20 if w["total_bytes"] is not None else None, 1),
                ]
                for mode, m in summary["modes"].items()
                for w in m["windows"]
            ],
        )
    lines += modes_section(result)
    return finish(lines, result, plots, problems(result))


def plot(result: dict[str, Any], summary: dict[str, Any], path: Path) -> bool:
    """Per window and mode: ack -> receive p99, rate share and dead tuples; the hold shaded."""
    from bench.plots import mode_colors, plt  # matplotlib only when plotting

    modes, cfg = summary["modes"], result["config"]
    if not modes:
        return False
    colors = mode_colors(list(modes))
    fig, axes = plt.subplots(3, 1, figsize=(10, 9.5), sharex=True)
    for mode, m in modes.items():
        ws = m["windows"]
        mid = [(w["start_s"] + w["seconds"] / 2) / 60 for w in ws]
        for ax, key, scale in (
            (axes[0], "p99", 1.0),
            (axes[1], "rate_share", 100.0),
            (axes[2], "dead_tuples", 1e-3),
        ):
            pts = [(x, w[key] * scale) for x, w in zip(mid, ws, strict=True) if w[key] is not None]
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                markersize=3,
                color=colors[mode],
                label=mode,
            )
    start = cfg["baseline"] / 60
    for ax in axes:
        ax.axvspan(start, start + cfg["hold"] / 60, color="grey", alpha=0.15, lw=0)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("commit ack -> receive p99 (ms)")
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("producers' rate, % of offered")
    axes[1].axhline(90, color="grey", linewidth=0.8, alpha=0.6)
    axes[2].set_ylabel("outbox dead tuples (thousands)")
    axes[2].set_xlabel("minutes since the load started (grey: snapshot held)")
    fig.suptitle(
        f"Held snapshot: {cfg['rate']:g} ev/s, {cfg['window']:g} s windows, medians over rounds"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


REGIME = Regime.of(__name__, _HeldSnapshot.main, "## Targets", "## Per window")
