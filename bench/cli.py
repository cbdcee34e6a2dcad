"""The command line: ``python -m bench run | smoke | drain | recovery | held-snapshot |
failing-head | stalled-relay | eos-freeze | inbox | fleet | report``.

Exit codes: 0 done; 1 the bench itself broke (a process failed, events went missing at a light
load, a smoke check failed); 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.config import (
    DEFAULT_MODES,
    MODES,
    VARIANTS,
    RunConfig,
    add_alt_modes,
    alt_tree,
    compare_rev_option,
    full_config,
    output_options,
    quick_config,
    smoke_config,
)
from bench.procs import BenchError
from bench.revs import compare_tree, with_alt_modes


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Latency and throughput of notify-outbox vs plain polling, side by side.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("run", help="the full bench (about 20 minutes; --quick: a few)")
    p.add_argument("--quick", action="store_true", help="every phase, small and short")
    p.add_argument(
        "--modes",
        nargs="+",
        help=f"default: {' '.join(DEFAULT_MODES)}; all: {' '.join(MODES)} (and *-alt)",
    )
    alt = p.add_mutually_exclusive_group()
    alt.add_argument(
        "--alt-relay",
        type=Path,
        help="a copy of the source tree with a proposed relay change: adds the modes "
        "notify-alt, relay-poll-alt, ... (run from that tree) for A/B runs",
    )
    compare_rev_option(alt)
    p.add_argument("--loads", nargs="+", type=float, help="offered loads, events/s")
    p.add_argument("--no-extend", action="store_true", help="do not raise loads past the list")
    p.add_argument("--duration", type=float, help="measured seconds per cell")
    p.add_argument("--warmup", type=float, help="warm-up seconds per cell")
    p.add_argument("--repeat", type=int, help="repetitions of every cell (medians reported)")
    p.add_argument("--writers", type=int, help="writer connections (default: by load)")
    p.add_argument(
        "--tx-events",
        type=int,
        help="latency cells: up to N already-due events per producing transaction "
        "(default 1: single-row transactions; more measures relay throughput past the "
        "machine's commit rate)",
    )
    p.add_argument("--idle-seconds", type=float, help="length of the idle measurement")
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), help="trigger variants")
    p.add_argument("--producer-writers", nargs="+", type=int, help="e.g. 1 4 16")
    p.add_argument("--producer-seconds", type=float, help="seconds per producer cell")
    p.add_argument("--variant-load", type=float, help="load of the Poisson/enqueue cells")
    p.add_argument("--variant-modes", nargs="*", help="modes with those cells")
    p.add_argument("--fsync-seconds", type=int, help="pg_test_fsync -s N (0: skip)")
    p.add_argument("--profile", action="store_true", help="py-spy the relay at the variant load")
    p.add_argument(
        "--stages",
        action="store_true",
        help="relay modes write a stage log (NOTIFY_OUTBOX_STAGE_LOG); the report breaks each "
        "event's commit ack -> receipt into the relay's stages",
    )
    p.add_argument(
        "--no-db-baseline",
        action="store_true",
        help="leave out the cells of the same writers with no relay (the database CPU a relay "
        "adds per event is then not reported)",
    )
    p.add_argument(
        "--skip",
        nargs="+",
        default=[],
        choices=["idle", "latency", "producer"],
        help="leave phases out (for development; a full result has all three)",
    )
    output_options(p)

    p = sub.add_parser("smoke", help="a few seconds of every phase; fails only if the bench breaks")
    p.add_argument("--out", type=Path, help="default: a new temporary directory")
    p.add_argument("--keep-work-dir", action="store_true")
    from bench.catalog import REGIMES  # every regime's module: only to make the parser

    for regime in REGIMES.values():
        regime.arguments(sub.add_parser(regime.name, help=regime.help))

    p = sub.add_parser("report", help="regenerate the markdown (and plots) of a result JSON")
    p.add_argument("json", type=Path)
    p.add_argument("--no-plots", action="store_true")
    return parser


def _run_regime(args: argparse.Namespace) -> int:
    """A regime (``drain``, ``recovery``, ``held-snapshot``, ...): run, write the report, show
    its main tables; exit 1 when a check failed (lost events, order violations, a timed-out
    cell, a cell that broke), not when the relay was merely slow."""
    from bench.catalog import REGIMES
    from bench.procs import run_async

    regime = REGIMES[args.command]
    coro = regime.run(regime.configure(args), args.out, keep=args.keep_work_dir)
    out: Path = args.out
    started = time.time()
    try:
        run_async(coro)
    finally:
        # The run writes its JSON even when it fails half-way; only this run's counts.
        written = sorted(
            (p for p in out.glob(f"{regime.name}-*.json") if p.stat().st_mtime >= started - 1),
            key=lambda p: p.stat().st_mtime,
        )
        if written:
            md = regime.write_report(written[-1], plots=not args.no_plots)
            print(f"result: {written[-1]}\nreport: {md}", file=sys.stderr)
    problems = regime.problems(json.loads(written[-1].read_text())) if written else ["no result"]
    if written:
        for line in regime.terminal_lines(json.loads(written[-1].read_text())):
            print(line, file=sys.stderr)
    for p in problems:
        print(f"bench {regime.name}: {p}", file=sys.stderr)
    return 1 if problems else 0


def _apply(cfg: RunConfig, args: argparse.Namespace) -> RunConfig:
    cfg.alt_relay = alt_tree(args.alt_relay)
    cfg.alt_revision = args.alt_revision
    if cfg.alt_relay is not None:
        add_alt_modes(cfg.alt_relay)
    unknown = [m for m in args.modes or [] if m not in MODES]
    if unknown:
        raise BenchError(f"unknown mode(s) {unknown}; known: {sorted(MODES)}")
    if args.modes:
        cfg.modes = list(dict.fromkeys(args.modes))
    if args.loads:
        cfg.loads = sorted(args.loads)
    if args.no_extend:
        cfg.extend_loads = False
    for flag, attr in (
        *((f, f) for f in ("duration", "warmup", "repeat", "writers", "tx_events")),
        *((f, f) for f in ("idle_seconds", "producer_seconds", "variant_load")),
        ("fsync_seconds", "fsync_test_seconds"),
    ):
        value = getattr(args, flag)
        if value is not None:
            setattr(cfg, attr, value)
    if args.repeat is not None:
        cfg.producer_repeat = args.repeat
    if args.variants:
        cfg.variants = list(dict.fromkeys(args.variants))
    if args.producer_writers:
        cfg.producer_writers = args.producer_writers
    if args.variant_modes is not None:
        cfg.variant_modes = [m for m in args.variant_modes if m in cfg.modes]
    cfg.variant_modes = [m for m in cfg.variant_modes if m in cfg.modes]
    if cfg.alt_revision:
        # The compared revision beside every relay mode (and its variant cells), interleaved.
        def alt_of(m: str) -> str | None:
            return f"{m}-alt" if f"{m}-alt" in MODES else None

        cfg.modes = with_alt_modes(cfg.modes, alt_of)
        cfg.variant_modes = with_alt_modes(cfg.variant_modes, alt_of)
    cfg.profile = args.profile
    cfg.stages = args.stages
    cfg.db_baseline = not args.no_db_baseline
    cfg.skip = list(args.skip)
    return cfg


def _run(cfg: RunConfig, out: Path, *, keep: bool, plots: bool) -> Path:
    from bench.report import floor_lines, write_run_report
    from bench.runner import Runner

    runner = Runner(cfg, out, keep_work_dir=keep)
    try:
        path = asyncio.run(runner.run())
    finally:
        written = out / f"{runner.run_id}.json"
        if written.exists():
            md = write_run_report(written, plots=plots)
            for line in floor_lines(json.loads(written.read_text())):
                print(line, file=sys.stderr)
            print(f"result: {written}\nreport: {md}", file=sys.stderr)
    return path


def _check_smoke(path: Path, cfg: RunConfig) -> list[str]:
    """What a smoke run must have produced."""
    result = json.loads(path.read_text())
    problems = []
    for mode in cfg.modes:
        cells = [c for c in result["latency_cells"] if c["mode"] == mode]
        if not cells:
            problems.append(f"no latency cell for mode {mode}")
        for c in cells:
            if c["missing"] or c["unsent"] or c["failed"] or not c["events"]:
                problems.append(
                    f"mode {mode} cell {c['cell']}: {c['events']} events, {c['missing']} "
                    f"missing, {c['unsent']} unsent, {c['failed']} failed"
                )
            if cfg.stages and MODES[mode].kind == "relay" and "stage_log" not in c:
                problems.append(f"mode {mode} cell {c['cell']}: no stage-log record")
        if MODES[mode].kind != "floor" and not any(i["mode"] == mode for i in result["idle"]):
            problems.append(f"no idle measurement for mode {mode}")
    relays = [m for m in cfg.modes if MODES[m].kind == "relay"]
    if cfg.db_baseline and relays and result.get("postmaster_pid"):
        if not any(c.get("db_cpu_us_per_event") for c in result.get("baseline_cells", [])):
            problems.append("no database CPU measured for the writers with no relay")
        for c in result["latency_cells"]:
            if MODES[c["mode"]].kind != "floor" and c.get("db_cpu_us_per_event") is None:
                problems.append(f"mode {c['mode']} cell {c['cell']}: no database CPU")
    for v in cfg.variants:
        if not any(p["variant"] == v and p["commits"] > 0 for p in result["producer_cells"]):
            problems.append(f"no producer-overhead cell with commits for variant {v}")
    return problems


# The bench's own child processes (``python -m bench _loadgen ...``; not for people): each
# module's ``main``, dispatched before argparse.
_HELPERS = ("_loadgen", "_consumer", "_poller", "_freezer", "_tally")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _HELPERS:
        helper = importlib.import_module(f"bench.{argv[0][1:]}")
        return int(helper.main(argv[1:]))
    args = _parser().parse_args(argv)
    try:
        if args.command == "report":
            from bench.catalog import write_report

            print(write_report(args.json, plots=not args.no_plots))
            return 0
        if args.command == "smoke":
            cfg = smoke_config()
            out = args.out or Path(tempfile.mkdtemp(prefix="notify-outbox-bench-smoke-"))
            path = _run(cfg, out, keep=args.keep_work_dir, plots=True)
            problems = _check_smoke(path, cfg)
            for p in problems:
                print(f"smoke: {p}", file=sys.stderr)
            return 1 if problems else 0
        with compare_tree(getattr(args, "compare_rev", None)) as alt:
            args.alt_revision = alt.to_json() if alt else None
            if alt is not None:
                args.alt_relay = alt.tree
                print(
                    f"bench: --compare-rev {alt.ref}: {alt.revision} “{alt.subject}” in {alt.tree}",
                    file=sys.stderr,
                )
            if args.command != "run":
                return _run_regime(args)
            cfg = _apply(quick_config() if args.quick else full_config(), args)
            _run(cfg, args.out, keep=args.keep_work_dir, plots=not args.no_plots)
            return 0
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
