"""The command line: ``python -m bench run | smoke | report``.

Exit codes: 0 done; 1 the bench itself broke (a process failed, events went missing at a light
load, a smoke check failed); 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.config import (
    DEFAULT_MODES,
    MODES,
    VARIANTS,
    RunConfig,
    add_alt_modes,
    full_config,
    quick_config,
    smoke_config,
)
from bench.procs import ROOT, BenchError

__all__ = ["main"]

DEFAULT_OUT = ROOT / "bench" / "results"


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
    p.add_argument(
        "--alt-relay",
        type=Path,
        help="a copy of the source tree with a proposed relay change: adds the modes "
        "notify-alt, relay-poll-alt, ... (run from that tree) for A/B runs",
    )
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
        "--skip",
        nargs="+",
        default=[],
        choices=["idle", "latency", "producer"],
        help="leave phases out (for development; a full result has all three)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    p.add_argument("--keep-work-dir", action="store_true", help="keep logs and the stack dir")
    p.add_argument("--no-plots", action="store_true")

    p = sub.add_parser("smoke", help="a few seconds of every phase; fails only if the bench breaks")
    p.add_argument("--out", type=Path, help="default: a new temporary directory")
    p.add_argument("--keep-work-dir", action="store_true")

    p = sub.add_parser("report", help="regenerate the markdown (and plots) of a result JSON")
    p.add_argument("json", type=Path)
    p.add_argument("--no-plots", action="store_true")
    return parser


def _apply(cfg: RunConfig, args: argparse.Namespace) -> RunConfig:
    if args.alt_relay is not None:
        tree = args.alt_relay.resolve()
        if not (tree / "notify_outbox" / "__main__.py").is_file():
            raise BenchError(f"--alt-relay {tree}: no notify_outbox/ package there")
        add_alt_modes(str(tree))
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
        ("duration", "duration"),
        ("warmup", "warmup"),
        ("repeat", "repeat"),
        ("writers", "writers"),
        ("tx_events", "tx_events"),
        ("idle_seconds", "idle_seconds"),
        ("producer_seconds", "producer_seconds"),
        ("variant_load", "variant_load"),
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
    cfg.profile = args.profile
    cfg.skip = list(args.skip)
    return cfg


def _run(cfg: RunConfig, out: Path, *, keep: bool, plots: bool) -> Path:
    from bench.report import write_report
    from bench.runner import Runner

    runner = Runner(cfg, out, keep_work_dir=keep)
    try:
        path = asyncio.run(runner.run())
    finally:
        written = out / f"{runner.run_id}.json"
        if written.exists():
            md = write_report(written, plots=plots)
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
        if not any(i["mode"] == mode for i in result["idle"]):
            problems.append(f"no idle measurement for mode {mode}")
    for v in cfg.variants:
        if not any(p["variant"] == v and p["commits"] > 0 for p in result["producer_cells"]):
            problems.append(f"no producer-overhead cell with commits for variant {v}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The bench's own child processes (not for people): dispatched before argparse.
    if argv and argv[0] == "_loadgen":
        from bench import loadgen

        return loadgen.main(argv[1:])
    if argv and argv[0] == "_consumer":
        from bench import consumer

        return consumer.main(argv[1:])
    if argv and argv[0] == "_poller":
        from bench import poller

        return poller.main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        if args.command == "report":
            from bench.report import write_report

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
        cfg = _apply(quick_config() if args.quick else full_config(), args)
        _run(cfg, args.out, keep=args.keep_work_dir, plots=not args.no_plots)
        return 0
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
